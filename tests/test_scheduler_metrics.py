"""A scheduler pass moves its figures at /metrics (issue 34.6): passes and their duration,
sessions placed, left waiting and preempted; kept in Redis (this worker's own db), or in memory
without Redis (standalone). Real PostgreSQL and Redis; the endpoint's text read back."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from sessions.scheduling import pass_metrics
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db
TOKEN = "metrics-token-0123456789"


@pytest.fixture
def no_figures():
    """No pass recorded yet: this test's Redis db holds no figures (nor the process's memory)."""
    if settings.REDIS_URL:
        from sessions.lifecycle.passes import _redis

        _redis().delete(pass_metrics.KEY)
    pass_metrics._memory.clear()
    yield
    pass_metrics._memory.clear()


def scrape() -> dict[str, float]:
    """The scheduler's pass samples at /metrics: {name{labels}: value}."""
    with override_settings(FGPU_METRICS_TOKEN=TOKEN):
        response = APIClient().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            if s.name.startswith(("fgpu_scheduler_pass", "fgpu_scheduler_placed", "fgpu_scheduler_preempted",
                                  "fgpu_scheduler_last_pass")):
                out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


def two_placed_one_waiting(user) -> None:
    make_cluster(nodes={"n1": [mock_gpu(0)]})  # one 8 GiB GPU: 2 fGPU
    for i in range(3):
        admission.session_create(owner=user, name=f"s{i}", resources={"cuda.shares": "1"})
    assert len(schedule_pending()) == 2


def assert_one_pass_placed_two_and_left_one(before: dict[str, float], after: dict[str, float]) -> None:
    assert after["fgpu_scheduler_pass_duration_seconds_count{}"] == before["fgpu_scheduler_pass_duration_seconds_count{}"] + 1
    assert after["fgpu_scheduler_pass_duration_seconds_sum{}"] > before["fgpu_scheduler_pass_duration_seconds_sum{}"]
    assert after["fgpu_scheduler_pass_duration_seconds_bucket{le=+Inf}"] == after["fgpu_scheduler_pass_duration_seconds_count{}"]
    assert after["fgpu_scheduler_pass_duration_seconds_bucket{le=10.0}"] == before[
        "fgpu_scheduler_pass_duration_seconds_bucket{le=10.0}"] + 1  # a pass of a few sessions: well under 10 s
    assert after["fgpu_scheduler_placed_sessions_total{}"] == before["fgpu_scheduler_placed_sessions_total{}"] + 2
    assert after["fgpu_scheduler_last_pass_waiting_sessions{}"] == 1
    assert after["fgpu_scheduler_preempted_sessions_total{stage=noticed}"] == 0
    assert after["fgpu_scheduler_preempted_sessions_total{stage=stopped}"] == 0
    assert after["fgpu_scheduler_last_pass_timestamp_seconds{}"] > before["fgpu_scheduler_last_pass_timestamp_seconds{}"]


def test_before_any_pass_the_figures_are_exported_as_zeros(no_figures):
    figures = scrape()
    assert figures["fgpu_scheduler_pass_duration_seconds_count{}"] == 0
    assert figures["fgpu_scheduler_placed_sessions_total{}"] == 0
    assert figures["fgpu_scheduler_last_pass_timestamp_seconds{}"] == 0


def test_a_pass_counts_its_duration_placed_and_waiting_sessions_in_redis(alice, no_figures):
    assert settings.REDIS_URL  # the tests' Redis: the worker's passes and the web's scrape meet there
    before = scrape()
    two_placed_one_waiting(alice)
    assert_one_pass_placed_two_and_left_one(before, scrape())


def test_a_pass_counts_in_memory_without_redis(alice, no_figures):
    with override_settings(REDIS_URL=""):
        before = scrape()
        two_placed_one_waiting(alice)
        assert_one_pass_placed_two_and_left_one(before, scrape())


def test_an_empty_pass_is_a_pass_that_leaves_no_one_waiting(no_figures):
    schedule_pending()
    figures = scrape()
    assert figures["fgpu_scheduler_pass_duration_seconds_count{}"] == 1
    assert figures["fgpu_scheduler_last_pass_waiting_sessions{}"] == 0


def test_an_unreachable_redis_loses_the_figures_not_the_pass_nor_the_scrape(alice, no_figures, caplog):
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):  # nothing listens on port 1
        two_placed_one_waiting(alice)
        with override_settings(FGPU_METRICS_TOKEN=TOKEN):
            response = APIClient().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200 and b"fgpu_scheduler_pending_sessions 1.0" in response.content
    assert b"fgpu_scheduler_pass_duration_seconds" not in response.content  # a gap, not zeros
    assert "could not record the scheduler pass's figures" in caplog.text
