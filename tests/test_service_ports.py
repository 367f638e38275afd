"""Backend.AI's `ai.backend.service-ports` image label (issue 16, item 1): the parser (Backend.AI's
grammar and rules; a malformed label is refused whole with the entry and the rule named), the
apps it gives, the record's own apps winning, and the manager taking a docker node's labels into
the image records (a malformed one changes nothing)."""
from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from sessions.policy.images import image_service_ports_apply
from sessions.models import SessionImage, validate_image_labels
from sessions.service_ports import (SERVICE_PORTS_LABEL, ServicePortsError, apps_from_service_ports, jupyter_app,
                                    merged_apps, parse_service_ports)


def test_backend_ai_labels_parse_into_entries_with_their_ports():
    assert parse_service_ports("jupyter:http:8080,jupyterlab:http:8090") \
        == [{"name": "jupyter", "protocol": "http", "ports": (8080,)},
            {"name": "jupyterlab", "protocol": "http", "ports": (8090,)}]
    assert parse_service_ports("vscode:http:[8180,8181],ttyd:pty:7682,code-server:preopen:9000") == [
        {"name": "vscode", "protocol": "http", "ports": (8180, 8181)},
        {"name": "code-server", "protocol": "preopen", "ports": (9000,)}]  # pty skipped, as Backend.AI does
    assert parse_service_ports("") == []


@pytest.mark.parametrize("label, words", [
    ("jupyter:http", "entry 1 ('jupyter:http') is not name:protocol:port"),
    ("jupyter:http:8080;tensorboard:http:6006", "entry 1 ('jupyter:http:8080;tensorboard:http:6006') is not"),
    ("jupyter:http:8080,,x:http:9000", "entry 2 ('') is not name:protocol:port"),
    ("jupyter:http:8080,", "a comma ends the label"),
    ("jupyter:http:eighty", "entry 1 ('jupyter:http:eighty') is not"),
    ("jupyter:ftp:8080", "entry 1 (jupyter): protocol 'ftp' is not one of tcp, http, preopen"),
    ("a:http:8080,b:http:8080", "entry 2 (b): port 8080 is used by another entry"),
    ("a:http:[9000,9000]", "entry 1 (a): port 9000 is used by another entry"),
    ("a:http:80", "port 80 must be above 1024"),
    ("a:http:65535", "port 65535 must be below 65535"),
    ("a:http:8080,b:tcp:7681", "entry 2 (b): port 7681 is reserved"),
    ("a b:http:8080", "entry 1 ('a b:http:8080') is not"),
    ("x" * 1025, "at most 1024 characters"),
])
def test_malformed_labels_are_refused_whole_naming_the_entry_and_the_rule(label, words):
    with pytest.raises(ServicePortsError) as refused:
        parse_service_ports(label)
    assert words in str(refused.value) and str(refused.value).startswith(SERVICE_PORTS_LABEL)


def test_known_http_entries_become_apps_on_their_first_port_and_the_others_are_explained():
    apps, notes = apps_from_service_ports("jupyterlab:http:8090,tensorboard:http:6006,sshd:tcp:2222")

    assert apps == [jupyter_app(name="jupyterlab", title="JupyterLab", port=8090)]
    assert apps[0]["command"].startswith("exec python3 -m jupyterlab ") and "{token}" in apps[0]["command"]
    assert notes == ["tensorboard: no command known for it (declare it in the image's apps)",
                     "sshd: a tcp service (the console proxies HTTP apps only)"]
    notebook, _ = apps_from_service_ports("jupyter:http:8080")
    assert notebook[0]["name"] == "jupyter" and " -m notebook " in notebook[0]["command"] and notebook[0]["port"] == 8080


def test_the_records_own_apps_win_by_name_and_a_malformed_label_adds_nothing():
    mine = {"name": "jupyterlab", "title": "Our lab", "command": "exec lab --port {port}", "port": 9999}
    labels = {SERVICE_PORTS_LABEL: "jupyterlab:http:8090,jupyter:http:8080"}

    assert [(a["name"], a["port"]) for a in merged_apps([mine], labels)] == [("jupyterlab", 9999), ("jupyter", 8080)]
    assert merged_apps([mine], {SERVICE_PORTS_LABEL: "jupyter:http"}) == [mine]
    assert merged_apps([], {"framework": "pytorch"}) == []


def test_a_label_app_the_record_offers_under_another_name_is_offered_once():
    # The demo's image: its record names JupyterLab "jupyter", its label "jupyterlab": one button, the record's.
    mine = {"name": "jupyter", "title": "JupyterLab", "command": "exec jupyter lab --port {port}", "port": 8888}
    labels = {SERVICE_PORTS_LABEL: "jupyterlab:http:8090"}

    assert merged_apps([mine], labels) == [mine]
    assert [a["name"] for a in merged_apps([{**mine, "title": "Notebook"}], labels)] == ["jupyter", "jupyterlab"]


def test_an_administrator_cannot_write_a_malformed_label_and_is_told_why():
    validate_image_labels({SERVICE_PORTS_LABEL: "jupyterlab:http:8090"})
    with pytest.raises(ValidationError) as refused:
        validate_image_labels({SERVICE_PORTS_LABEL: "jupyterlab:http:443"})
    assert "port 443 must be above 1024" in str(refused.value)


@pytest.mark.django_db
def test_a_docker_nodes_labels_give_the_matching_records_their_apps_and_a_malformed_one_changes_nothing(caplog):
    from sessions.serving.session_apps import session_apps
    from sessions.models import ComputeSession
    from django.contrib.auth import get_user_model

    lab = SessionImage.objects.create(reference="docker.io/library/lab:1", labels={"framework": "none"})
    bad = SessionImage.objects.create(reference="bad:1", apps=[{"name": "x", "command": "x", "port": 9000}],
                                      labels={SERVICE_PORTS_LABEL: "jupyter:http:8080"})
    images = {"lab:1": "sha256:aaa", "bad:1": "sha256:bbb", "later:1": "sha256:ccc"}
    ports = {"sha256:aaa": "jupyterlab:http:8090", "sha256:bbb": "jupyter:http:80", "sha256:ccc": "jupyter:http:8080"}

    changed = image_service_ports_apply(node_name="gpu-1", images=images, service_ports=ports)

    assert changed == ["docker.io/library/lab:1"]  # matched in image_key form
    lab.refresh_from_db()
    bad.refresh_from_db()
    assert lab.labels == {"framework": "none", SERVICE_PORTS_LABEL: "jupyterlab:http:8090"}
    assert bad.labels == {SERVICE_PORTS_LABEL: "jupyter:http:8080"} and bad.apps[0]["name"] == "x"  # nothing lost
    assert "node gpu-1: image bad:1 carries a malformed label" in caplog.text and "port 80 must be above 1024" in caplog.text
    owner = get_user_model().objects.create_user("u")
    session = ComputeSession.objects.create(name="s", owner=owner, resources={}, image=lab)
    assert [(a["name"], a["port"], a["title"]) for a in session_apps(session)] == [("jupyterlab", 8090, "JupyterLab")]

    # A record created after the node reported the image takes the label at the next report; an
    # unchanged label is not written again.
    SessionImage.objects.create(reference="later:1")
    assert image_service_ports_apply(node_name="gpu-1", images=images, service_ports=ports) == ["later:1"]
    assert image_service_ports_apply(node_name="gpu-1", images=images, service_ports=ports) == []
    assert image_service_ports_apply(node_name="gpu-1", images=images, service_ports="nonsense") == []


@pytest.mark.django_db
def test_the_image_api_refuses_a_malformed_label_naming_labels_and_keeps_the_record(staff):
    from tests.conftest import client_for

    host = SessionImage.objects.get(reference="host")
    client = client_for(staff)
    tag = client.get(f"/api/v1/images/{host.pk}/")["ETag"]
    refused = client.patch(f"/api/v1/images/{host.pk}/", {"labels": {SERVICE_PORTS_LABEL: "lab:http:[9000,9000]"}},
                           format="json", HTTP_IF_MATCH=tag)
    assert refused.status_code == 400
    assert "entry 1 (lab): port 9000 is used by another entry" in str(refused.json()["field_errors"]["labels"])
    host.refresh_from_db()
    assert host.labels == {}
