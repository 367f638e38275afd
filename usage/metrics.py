"""`GET /metrics`: Prometheus' exposition format through the official client library
(prometheus_client), read from the database at each scrape (any web process answers the same).

Protected by a token: `Authorization: Bearer <FGPU_METRICS_TOKEN>` (Prometheus' `authorization`
/ `bearer_token` in a scrape config); unset, /metrics is off (404). A missing or wrong token is 401.

Names follow NVIDIA's DCGM exporter and HAMi where they mean the same:

| metric | labels | unit | from |
|---|---|---|---|
| `DCGM_FI_DEV_FB_USED`, `DCGM_FI_DEV_FB_FREE` | gpu, UUID, modelName, Hostname | MiB | DCGM exporter |
| `DCGM_FI_DEV_GPU_UTIL` | same | percent | DCGM exporter |
| `vGPU_device_memory_usage_in_bytes`, `vGPU_device_memory_limit_in_bytes` | session, session_name, user, node | bytes | HAMi |
| `Device_utilization_desc_of_container` | same | percent | HAMi |
| `fgpu_session_granted_fgpu` | same | fGPU | ours |
| `fgpu_session_cpu_millicores`, `fgpu_session_memory_bytes` | same | milli-cores, bytes | ours |
| `fgpu_node_free_fgpu`, `fgpu_node_capacity_fgpu` | node | fGPU | ours |
| `fgpu_scheduler_pending_sessions` | | sessions | ours |
| `fgpu_scheduler_placement_latency_seconds` | | histogram, seconds from launch to placement | ours |
| `fgpu_session_launches_total` | outcome (started, failed, cancelled) | sessions | ours |
| `fgpu_scheduler_pass_duration_seconds` | | histogram, seconds a pass took | Kueue's `admission_attempt_duration_seconds` |
| `fgpu_scheduler_placed_sessions_total` | | sessions placed by passes | ours |
| `fgpu_scheduler_preempted_sessions_total` | stage (noticed, stopped) | sessions | Kueue's `preempted_workloads_total` |
| `fgpu_scheduler_last_pass_waiting_sessions` | | sessions the last pass left waiting | Kueue's `pending_workloads` |
| `fgpu_scheduler_last_pass_timestamp_seconds` | | Unix seconds the last pass ended | ours |

The scheduler's pass figures are kept by `sessions.scheduling.pass_metrics` (Redis; in memory standalone).

Per-device and per-session usage figures are the newest sample of the last SAMPLE_HORIZON_S
seconds: a device or session whose agent sent nothing for longer is left out (a gap in
Prometheus too, never a stale or zero value).
"""

from __future__ import annotations

import hmac
import logging
import time
from datetime import timedelta
from decimal import Decimal

import redis
from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.http import Http404, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from accelerators.models import Device, Node
from accelerators.selectors import device_fgpu_summary, devices_with_usage
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.pass_metrics import BUCKETS as PASS_BUCKETS
from sessions.scheduling.pass_metrics import pass_figures
from usage.selectors import latest_device_samples, latest_session_samples

log = logging.getLogger(__name__)

MiB = 1 << 20
SAMPLE_HORIZON_S = 60
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)


class ConsoleCollector:
    """Reads the database once per scrape (a handful of queries, whatever the cluster's size)."""

    def collect(self):
        horizon = int(time.time()) - SAMPLE_HORIZON_S
        yield from self._devices(horizon)
        yield from self._sessions(horizon)
        yield from self._nodes()
        yield from self._scheduler()

    def _devices(self, horizon: int):
        labels = ["gpu", "UUID", "modelName", "Hostname"]
        used = GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=labels)
        free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=labels)
        util = GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=labels)
        for d in latest_device_samples(horizon=horizon):
            values = [str(d["index"]), d["uuid"], d["model"], d["node"]]
            used.add_metric(values, d["memory_used"] // MiB)
            free.add_metric(values, max(0, d["memory_total"] - d["memory_used"]) // MiB)
            if d["util"] is not None:
                util.add_metric(values, d["util"])
        yield from (used, free, util)

    def _sessions(self, horizon: int):
        labels = ["session", "session_name", "user", "node"]
        usage = GaugeMetricFamily("vGPU_device_memory_usage_in_bytes", "GPU memory a session uses (bytes).", labels=labels)
        limit = GaugeMetricFamily("vGPU_device_memory_limit_in_bytes", "GPU memory a session was granted (bytes).", labels=labels)
        util = GaugeMetricFamily("Device_utilization_desc_of_container", "GPU utilisation of a session (percent).", labels=labels)
        granted = GaugeMetricFamily("fgpu_session_granted_fgpu", "fGPU a session holds.", labels=labels)
        cpu = GaugeMetricFamily("fgpu_session_cpu_millicores", "CPU a session uses (milli-cores).", labels=labels)
        mem = GaugeMetricFamily("fgpu_session_memory_bytes", "Main memory a session holds resident (bytes).", labels=labels)
        latest = latest_session_samples(horizon=horizon)
        held = (
            Allocation.objects.filter(released_at__isnull=True)
            .values("session_id", "session__name", "session__owner__username", "session__node__name")
            .annotate(memory=Sum("memory"), shares=Sum("shares"))
        )
        for row in held:
            values = [
                str(row["session_id"]),
                row["session__name"],
                row["session__owner__username"],
                row["session__node__name"] or "",
            ]
            limit.add_metric(values, row["memory"])
            granted.add_metric(values, float(row["shares"]))
            sample = latest.get(row["session_id"])
            if sample is None:
                continue
            gpu_memory, gpu_util, millicores, resident = sample
            for family, value in ((usage, gpu_memory), (util, gpu_util), (cpu, millicores), (mem, resident)):
                if value is not None:
                    family.add_metric(values, value)
        yield from (usage, limit, util, granted, cpu, mem)

    def _nodes(self):
        free = GaugeMetricFamily("fgpu_node_free_fgpu", "fGPU a node has free (fractional devices).", labels=["node"])
        capacity = GaugeMetricFamily("fgpu_node_capacity_fgpu", "fGPU a node holds (fractional devices).", labels=["node"])
        devices = list(devices_with_usage(Device.objects.filter(node__status="ALIVE")).select_related("node"))
        totals: dict[str, list[Decimal]] = {}
        summaries = device_fgpu_summary(devices)
        for device in devices:
            summary = summaries[device.pk]
            if summary.capacity is not None:
                node = totals.setdefault(device.node.name, [Decimal(0), Decimal(0)])
                node[0] += summary.free
                node[1] += summary.capacity
        for name in Node.objects.filter(status="ALIVE").values_list("name", flat=True):
            f, c = totals.get(name, (Decimal(0), Decimal(0)))
            free.add_metric([name], float(f))
            capacity.add_metric([name], float(c))
        yield from (free, capacity)

    def _scheduler(self):
        pending = GaugeMetricFamily("fgpu_scheduler_pending_sessions", "Sessions waiting to be placed.")
        pending.add_metric([], ComputeSession.objects.filter(status=SessionStatus.PENDING).count())
        yield pending
        placed = ComputeSession.objects.filter(scheduled_at__isnull=False)
        counts = placed.aggregate(
            total=Count("id"),
            **{
                f"le_{i}": Count("id", filter=Q(scheduled_at__lte=F("created_at") + timedelta(seconds=b)))
                for i, b in enumerate(LATENCY_BUCKETS)
            },
        )
        histogram = HistogramMetricFamily(
            "fgpu_scheduler_placement_latency_seconds", "Seconds from launch to placement (all sessions placed)."
        )
        buckets = [(str(b), counts[f"le_{i}"]) for i, b in enumerate(LATENCY_BUCKETS)] + [("+Inf", counts["total"])]
        histogram.add_metric([], buckets, sum_value=_latency_sum(placed))
        yield histogram
        outcomes = CounterMetricFamily("fgpu_session_launches", "Launches by outcome.", labels=["outcome"])
        tally = ComputeSession.objects.aggregate(
            started=Count("id", filter=Q(started_at__isnull=False)),
            failed=Count("id", filter=Q(started_at__isnull=True, status=SessionStatus.ERROR)),
            cancelled=Count("id", filter=Q(started_at__isnull=True, status=SessionStatus.CANCELLED)),
        )
        for outcome, count in tally.items():
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield from _passes()


def _passes():
    """The scheduler passes' figures (`sessions.scheduling.pass_metrics`); none while Redis cannot be
    reached (a gap, not zeros)."""
    try:
        figures = pass_figures()
    except redis.RedisError:
        log.warning("the scheduler's pass figures are not exported: Redis cannot be reached", exc_info=True)
        return
    duration = HistogramMetricFamily(
        "fgpu_scheduler_pass_duration_seconds", "Seconds a scheduler pass took (its commit included)."
    )
    buckets = [(str(b), figures[f"le_{b}"]) for b in PASS_BUCKETS] + [("+Inf", figures["count"])]
    duration.add_metric([], buckets, sum_value=figures["sum"])
    placed = CounterMetricFamily("fgpu_scheduler_placed_sessions", "Sessions placed by scheduler passes.")
    placed.add_metric([], figures["placed"])
    preempted = CounterMetricFamily(
        "fgpu_scheduler_preempted_sessions",
        "Sessions preempted by scheduler passes: put under notice (noticed), stopped when it ran out (stopped).",
        labels=["stage"],
    )
    for stage in ("noticed", "stopped"):
        preempted.add_metric([stage], figures[stage])
    waiting = GaugeMetricFamily("fgpu_scheduler_last_pass_waiting_sessions", "Sessions the last scheduler pass left waiting.")
    waiting.add_metric([], figures["waiting"])
    at = GaugeMetricFamily("fgpu_scheduler_last_pass_timestamp_seconds", "When the last scheduler pass ended (Unix seconds).")
    at.add_metric([], figures["at"])
    yield from (duration, placed, preempted, waiting, at)


def _latency_sum(placed) -> float:
    """Σ seconds from launch to placement over `placed` (in the database: one row back)."""
    total = placed.aggregate(s=Sum(ExpressionWrapper(F("scheduled_at") - F("created_at"), output_field=DurationField())))["s"]
    return total.total_seconds() if total is not None else 0.0


def metrics_view(request):
    """The exposition (text format 0.0.4). 404 while FGPU_METRICS_TOKEN is unset; 401 without
    `Authorization: Bearer <token>` matching it."""
    token = settings.FGPU_METRICS_TOKEN
    if not token:
        raise Http404("metrics are off: set FGPU_METRICS_TOKEN")
    sent = request.headers.get("Authorization", "")
    if not (sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].encode(), token.encode())):
        response = HttpResponse("a bearer token is needed (FGPU_METRICS_TOKEN)\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConsoleCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
