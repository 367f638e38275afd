"""compose.yaml's Prometheus and Grafana (issue 15.3): Prometheus scrapes the web's /metrics with
the bearer token the web checks, Grafana's data source is the one the dashboard names, and every
metric the dashboard queries is one /metrics exports (read from a real scrape, so a renamed
metric fails here rather than leaving an empty panel)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import GiB, client_for, mock_gpu
from tests.test_reconcile import agent  # noqa: F401 (fixture used by test_usage's `running`)
from tests.test_usage import NODE, batch, running, sample  # noqa: F401 (fixture)
from usage.services import usage_ingest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fgpu-usage.json"
TOKEN = "compose-metrics-token-0123"
METRIC = re.compile(r"\b(?:DCGM_FI_\w+|vGPU_\w+|Device_utilization_\w+|fgpu_\w+)\b")


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"]]
    return exprs


def test_prometheus_scrapes_the_webs_metrics_with_the_token_compose_gives_both():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]

    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["web:8000"]
    assert "8000" in services["web"]["command"]
    token_file = scrape["authorization"]["credentials_file"]
    assert scrape["authorization"]["type"] == "Bearer"
    # The prometheus service writes the web's token to that file before it starts.
    assert f'"$$FGPU_METRICS_TOKEN" > {token_file}' in services["prometheus"]["command"][0]
    assert services["prometheus"]["environment"]["FGPU_METRICS_TOKEN"] == services["web"]["environment"]["FGPU_METRICS_TOKEN"]
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisions_the_data_source_the_dashboard_names_and_the_dashboard_from_the_repository():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    source = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "fgpu.yaml").read_text())
    board = json.loads(DASHBOARD.read_text())

    (prometheus,) = source["datasources"]
    assert prometheus["url"] == "http://prometheus:9090" and "prometheus" in services
    uids = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert uids == {prometheus["uid"]}
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in services["grafana"]["volumes"]
    assert len([p for p in board["panels"] if p["type"] != "row"]) >= 10


@pytest.mark.django_db(transaction=True)
def test_every_metric_the_dashboard_queries_is_one_metrics_exports(running):
    session = running()
    now = int(time.time())
    device = {"device": mock_gpu(0).device_id, "t": now - 5, "memory_used": GiB, "memory_total": 8 * GiB, "util": 30}
    usage_ingest(node_name=NODE, batch=batch(sample(session, now - 5), devices=[device]))

    with override_settings(FGPU_METRICS_TOKEN=TOKEN):
        response = client_for(None).get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")

    assert response.status_code == 200
    exported = {s.name for family in text_string_to_metric_families(response.content.decode()) for s in family.samples}
    queried = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert len(queried) >= 12, queried
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
