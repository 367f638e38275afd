"""Usage on the manager side (issue 15): storing the agents' samples (idempotent, refusing what
does not belong), 5-minute rollups with retention, charts' series with gaps, accounting per
user / project / node to the second, the usage API and CSV, `fgpu usage`, /metrics, and idle
reclamation. The database is real (PostgreSQL in CI); only the clock is given explicitly."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal

import pytest
from django.db.models import Max, Sum
from django.test import override_settings
from django.utils import timezone
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, Project, SessionStatus
from tests.conftest import GiB, client_for, mock_gpu
from tests.test_reconcile import agent  # noqa: F401 (fixture: the node's agent, a recording stand-in)
from usage import selectors
from usage.models import (
    DeviceRollup, DeviceSample, IdlePolicy, RollupState, SessionActivity, SessionPeriodRollup, SessionRollup,
    SessionSample,
)
from usage.services import usage_idle_check, usage_ingest, usage_rollup
from usage.tasks import usage_report
from protocol.messages import UsageBatch

pytestmark = pytest.mark.django_db(transaction=True)
NODE = "demo-node"
TOKEN = "metrics-token-0123456789"


@pytest.fixture
def running(agent, alice):
    """make(owner=alice, command="") → a RUNNING session on demo-node, started `age` seconds ago."""

    def make(owner=None, *, command: str = "", shares: str = "0.5", age: float = 0) -> ComputeSession:
        session = admission.session_create(owner=owner or alice, name="", resources={"cuda.shares": shares},
                                           command=command)
        services.session_report_apply(session_id=str(session.pk), status="RUNNING")
        ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timedelta(seconds=age))
        session.refresh_from_db()
        assert session.status == SessionStatus.RUNNING, session.status_reason
        return session

    return make


def sample(session, t: int, *, gpu_memory=1 * GiB, gpu_util=50, span=5, cpu=250, mem=100 << 20, last_input=None):
    return {"session_id": str(session.pk), "t": t, "span": span, "gpu_memory": gpu_memory, "gpu_util": gpu_util,
            "cpu": cpu, "mem": mem, "last_input": last_input}


def batch(*sessions, devices=()):
    """The samples as the usage task decodes them (protocol.messages.UsageBatch): the ingest's input."""
    return UsageBatch.decode({"node": NODE, "batch": {"interval": 5, "sessions": list(sessions), "devices": list(devices)}})


# --- ingestion ------------------------------------------------------------------------------------

def test_a_batch_is_stored_once_however_often_and_in_whatever_order_it_arrives(running):
    session = running()
    now = int(time.time())
    first = batch(sample(session, now - 10), sample(session, now - 5))
    second = batch(sample(session, now), sample(session, now - 5))

    assert usage_ingest(node_name=NODE, batch=second).stored == 2  # out of order: the later batch first
    again = usage_ingest(node_name=NODE, batch=first)
    assert (again.stored, again.duplicates) == (1, 1)
    assert usage_ingest(node_name=NODE, batch=second).duplicates == 2

    assert list(SessionSample.objects.filter(session=session).order_by("t").values_list("t", flat=True)) == [
        now - 10, now - 5, now]


def test_samples_of_unknown_sessions_other_nodes_sessions_and_ended_sessions_are_refused_not_raised(running, bob):
    session, ended = running(), running(owner=bob)
    now = int(time.time())
    services.session_report_apply(session_id=str(ended.pk), status="TERMINATED", exit_code=0)
    ended.refresh_from_db()
    before_end = int(ended.terminated_at.timestamp()) - 1
    unknown = {**sample(session, now), "session_id": "9a1f0c56-0000-4000-8000-000000000000"}

    result = usage_ingest(node_name=NODE, batch=batch(unknown, {**sample(session, now), "session_id": "not-a-uuid"},
                                                      sample(ended, now + 60), sample(ended, before_end)))
    elsewhere = usage_ingest(node_name="other-node", batch=batch(sample(session, now)))

    assert result.refused == {"unknown session": 2, "session ended": 1}
    assert result.stored == 1  # what it measured before it ended still counts
    assert elsewhere.refused == {"unknown session": 1} and elsewhere.stored == 0


def test_samples_older_than_the_closed_buckets_malformed_ones_and_a_malformed_batch_are_refused(running):
    session = running()
    now = int(time.time())
    RollupState.objects.create(pk=1, watermark=now - 600)

    result = usage_ingest(node_name=NODE, batch=batch(sample(session, now - 601), sample(session, now, gpu_util=101),
                                                      sample(session, now, gpu_memory=-1), {"t": now},
                                                      sample(session, now + 3600), sample(session, now)))

    assert result.refused == {"too late": 1, "malformed": 3, "from the future": 1}
    assert result.stored == 1
    assert usage_report(node=NODE, batch={"sessions": "x"})["refused"] == {"malformed batch": 1}
    assert usage_report(node=NODE, batch=[])["refused"] == {"malformed batch": 1}


def test_a_sample_with_a_null_time_or_span_is_malformed_and_the_rest_of_the_batch_is_stored(running):
    # mypy found it: the time and the span went through the nullable reader, and a null one failed the whole batch.
    session = running()
    now = int(time.time())
    null_device = {"device": mock_gpu(0).device_id, "t": None, "memory_used": 0, "memory_total": 8 * GiB, "util": 0}

    result = usage_ingest(node_name=NODE, batch=batch(sample(session, now - 5), {**sample(session, now), "t": None},
                                                      {**sample(session, now), "span": None}, devices=[null_device]))

    assert result.refused == {"malformed": 3}
    assert result.stored == 1
    assert list(SessionSample.objects.filter(session=session).values_list("t", flat=True)) == [now - 5]


def test_device_samples_are_stored_per_device_once_and_unknown_devices_refused(demo_cluster):
    now = int(time.time())
    uuid = mock_gpu(0).device_id
    device = {"device": uuid, "t": now, "memory_used": 3 * GiB, "memory_total": 8 * GiB, "util": 40}

    result = usage_ingest(node_name=NODE, batch=batch(devices=[device, device, {**device, "device": "GPU-nope"}]))

    assert (result.stored, result.refused) == (1, {"unknown device": 1})
    assert DeviceSample.objects.get().memory_used == 3 * GiB


def test_terminal_input_and_the_last_sample_move_the_sessions_activity_forward_only(running):
    session = running()
    now = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(sample(session, now, last_input=now - 3)))
    usage_ingest(node_name=NODE, batch=batch(sample(session, now - 20, last_input=now - 30)))  # a late batch

    activity = SessionActivity.objects.get(session=session)
    assert (activity.last_input, activity.last_sample) == (now - 3, now)


# --- rollups and retention -----------------------------------------------------------------------------

def test_rollups_keep_exact_sums_and_means_per_5_minutes_and_retention_drops_old_rows(running):
    session = running()
    # Three days ago, on an hour boundary: both 5-minute buckets fall in one hour (at xx:55 they made two: a failure).
    base = (int(time.time()) - 3 * 86400) // 3600 * 3600
    SessionSample.objects.bulk_create([
        SessionSample(session=session, t=base + 10, span=10, gpu_memory=2 * GiB, gpu_util=30, cpu=500, mem=1),
        SessionSample(session=session, t=base + 20, span=10, gpu_memory=4 * GiB, gpu_util=90, cpu=None, mem=3),
        SessionSample(session=session, t=base + 310, span=10, gpu_memory=None, gpu_util=None, cpu=100, mem=2),
    ])
    device = demo_cluster_device()
    DeviceSample.objects.create(device=device, t=base + 5, memory_used=6 * GiB, memory_total=8 * GiB, util=70)
    now = base + 3 * 86400

    with override_settings(FGPU_USAGE_RAW_RETENTION=86400, FGPU_USAGE_ROLLUP_RETENTION=90 * 86400):
        done = usage_rollup(now=now)
        again = usage_rollup(now=now)

    first, second = SessionRollup.objects.filter(session=session).order_by("bucket")
    assert (first.bucket, first.samples, first.span_s, first.gpu_span_s) == (base, 2, 20, 20)
    assert first.gpu_memory_s == (2 * GiB + 4 * GiB) * 10 and first.gpu_memory_max == 4 * GiB
    assert (first.gpu_util_s, first.gpu_util_max, first.cpu_s, first.mem_max) == (1200, 90, 5000, 3)
    assert (second.bucket, second.gpu_span_s, second.gpu_memory_max) == (base + 300, 0, None)
    assert DeviceRollup.objects.get().memory_used_avg == 6 * GiB
    assert done["watermark"] == (now - 3600) // 300 * 300 and done["deleted_samples"] == 4
    assert again["session_buckets"] == 0 and SessionSample.objects.count() == 0  # nothing new, nothing twice
    with override_settings(FGPU_USAGE_ROLLUP_RETENTION=86400):
        assert usage_rollup(now=now)["deleted_rollups"] == 3 + 2  # and the hour and the day they were summed into


def rollups(session, base: int, buckets: int, *, seed: int) -> list[SessionRollup]:
    """`buckets` 5-minute rollups of `session` from `base` on, with figures that differ per bucket."""
    return [SessionRollup(session=session, bucket=base + 300 * i, samples=60, span_s=300 - (i * seed) % 7,
                          gpu_memory_s=((i * 7919 + seed * 104729) % 9973) * 300 * (1 << 20),
                          gpu_memory_max=((i * 31 + seed) % 97) << 20, gpu_util_s=((i * 13 + seed) % 101) * 300,
                          gpu_util_max=(i * 17 + seed) % 101, gpu_span_s=300, cpu_s=(i * seed) % 4000 * 300,
                          mem_max=i + seed) for i in range(buckets)]


def test_hourly_and_daily_sums_are_the_5_minute_ones_added_up_and_a_second_run_changes_nothing(running):
    session = running()
    day0 = (int(time.time()) - 5 * 86400) // 86400 * 86400
    base = day0 + 2 * 86400 - 7 * 300  # 35 minutes before a midnight: a partial hour and a partial day first
    SessionRollup.objects.bulk_create(rollups(session, base, 2 * 288 + 40, seed=3))
    RollupState.objects.create(pk=1, watermark=base + 300 * (2 * 288 + 40))
    now = base + 300 * (2 * 288 + 40) + 3600  # the watermark stays where it is

    first = usage_rollup(now=now)
    hours_rows = {(r.start, r.width): r for r in SessionPeriodRollup.objects.all()}
    second = usage_rollup(now=now)

    mark = base + 300 * (2 * 288 + 40)
    assert (first["hour_watermark"], first["day_watermark"]) == (mark // 3600 * 3600, mark // 86400 * 86400)
    assert (second["hours"], second["days"]) == (0, 0)  # nothing new
    assert {(r.start, r.width): r for r in SessionPeriodRollup.objects.all()}.keys() == hours_rows.keys()
    for (start, width), row in hours_rows.items():
        inside = SessionRollup.objects.filter(session=session, bucket__gte=start, bucket__lt=start + width)
        expected = inside.aggregate(samples=Sum("samples"), span_s=Sum("span_s"), gpu_memory_s=Sum("gpu_memory_s"),
                                    gpu_memory_max=Max("gpu_memory_max"), gpu_util_s=Sum("gpu_util_s"),
                                    gpu_util_max=Max("gpu_util_max"), gpu_span_s=Sum("gpu_span_s"), cpu_s=Sum("cpu_s"),
                                    mem_max=Max("mem_max"))
        assert {name: getattr(row, name) for name in expected} == expected, (start, width)
    days = sorted(start for start, width in hours_rows if width == 86400)
    assert days == [day0 + 86400, day0 + 2 * 86400, day0 + 3 * 86400] and mark < day0 + 5 * 86400  # day 4 is open
    assert SessionPeriodRollup.objects.get(width=86400, start=day0 + 86400).samples == 7 * 60  # its last 35 minutes


def test_a_period_written_before_a_crash_is_rewritten_from_its_buckets_and_two_runs_at_once_write_each_once(running):
    session = running()
    base = (int(time.time()) - 3 * 86400) // 86400 * 86400
    SessionRollup.objects.bulk_create(rollups(session, base, 288, seed=5))
    RollupState.objects.create(pk=1, watermark=base + 86400)
    # a run that died after writing an hour from half its buckets, before moving the marks
    SessionPeriodRollup.objects.create(session=session, width=3600, start=base, samples=1, span_s=1, gpu_memory_s=1)
    now = base + 86400 + 3600

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_closing_connection(now), range(2)))

    hour = SessionPeriodRollup.objects.get(width=3600, start=base)
    assert hour.gpu_memory_s == sum(r.gpu_memory_s for r in rollups(session, base, 12, seed=5))
    assert SessionPeriodRollup.objects.filter(width=3600).count() == 24
    assert SessionPeriodRollup.objects.get(width=86400).samples == 288 * 60
    assert sorted(r["days"] for r in results) == [0, 1]  # the second waited for the first's lock, found nothing


def run_closing_connection(now: int) -> dict:
    from django.db import connection

    try:
        return usage_rollup(now=now)
    finally:
        connection.close()


def test_the_report_over_hourly_and_daily_sums_equals_the_report_over_5_minute_sums_for_any_range(running, staff):
    session, other = running(), running()
    day0 = (int(time.time()) - 6 * 86400) // 86400 * 86400
    base = day0 + 5 * 3600 + 600
    SessionRollup.objects.bulk_create(rollups(session, base, 3 * 288, seed=2) + rollups(other, base + 900, 700, seed=9))
    mark = base + 300 * 3 * 288
    RollupState.objects.create(pk=1, watermark=mark)
    SessionSample.objects.bulk_create([SessionSample(session=session, t=mark + 7 * i, span=7, gpu_memory=i << 20,
                                                     gpu_util=i % 100) for i in range(50)])
    rng = random.Random(15)
    ranges = [(base - 1000, mark + 400), (day0 + 86400, day0 + 2 * 86400), (base + 3 * 3600 + 7, base + 3 * 3600 + 900),
              (day0 + 86400 - 1, mark)]
    ranges += [tuple(sorted(rng.sample(range(base - 3600, mark + 600), 2))) for _ in range(20)]

    def report(t0, t1):
        return selectors.usage_report(user=staff, start=datetime.fromtimestamp(t0, dt_timezone.utc),
                                      end=datetime.fromtimestamp(t1, dt_timezone.utc), group_by="user")

    without = [report(t0, t1) for t0, t1 in ranges]
    usage_rollup(now=mark + 3600)
    assert SessionPeriodRollup.objects.filter(width=86400).count() >= 2  # the report has days to read

    assert [report(t0, t1) for t0, t1 in ranges] == without


def test_a_chart_longer_than_a_week_draws_hourly_means_the_open_hours_from_their_buckets(running):
    session = running()
    base = (int(time.time()) - 12 * 86400) // 3600 * 3600
    buckets = rollups(session, base, 10 * 288, seed=4)
    SessionRollup.objects.bulk_create(buckets)
    mark = base + 10 * 86400
    RollupState.objects.create(pk=1, watermark=mark)
    usage_rollup(now=mark + 3600)
    RollupState.objects.filter(pk=1).update(hour_watermark=mark - 2 * 3600)  # the last two hours not summed yet

    series = selectors.session_series(session=session, since=base, until=mark)
    week = selectors.session_series(session=session, since=mark - 86400, until=mark)

    assert series["resolution"] == "1h" and series["t"] == [base + 3600 * h for h in range(240)]
    for h in (0, 100, 238, 239):  # a summed hour and the two still open
        inside = buckets[12 * h:12 * h + 12]
        gpu_span = sum(b.gpu_span_s for b in inside)
        assert series["gpu_memory"][h] == sum(b.gpu_memory_s for b in inside) // gpu_span
        assert series["gpu_util"][h] == sum(b.gpu_util_s for b in inside) // gpu_span
        assert series["cpu"][h] == sum(b.cpu_s for b in inside) // sum(b.span_s for b in inside)
        assert series["mem"][h] == max(b.mem_max for b in inside)
    assert week["resolution"] == "5m" and len(week["t"]) == 288


def test_a_days_chart_ends_with_the_buckets_past_the_watermark_averaged_from_their_samples(running):
    session = running()
    mark = int(time.time()) // 300 * 300 - 3600
    RollupState.objects.create(pk=1, watermark=mark, hour_watermark=mark // 3600 * 3600)
    SessionRollup.objects.bulk_create(rollups(session, mark - 1200, 4, seed=1))
    SessionSample.objects.bulk_create([
        SessionSample(session=session, t=mark + 10, span=10, gpu_memory=GiB, gpu_util=20, cpu=100, mem=5),
        SessionSample(session=session, t=mark + 20, span=10, gpu_memory=3 * GiB, gpu_util=40, cpu=300, mem=7),
        SessionSample(session=session, t=mark + 310, span=10, gpu_memory=None, gpu_util=None, cpu=None, mem=1)])

    series = selectors.session_series(session=session, since=mark - 86400, until=mark + 3600)

    assert series["resolution"] == "5m"
    assert series["t"] == [mark - 1200, mark - 900, mark - 600, mark - 300, mark, mark + 300]
    assert (series["gpu_memory"][-2:], series["gpu_util"][-2:]) == ([2 * GiB, None], [30, None])
    assert (series["cpu"][-2:], series["mem"][-2:]) == ([200, 0], [7, 1])


def demo_cluster_device():
    from accelerators.models import Device

    return Device.objects.get(node__name=NODE)


def test_the_series_of_a_session_has_a_gap_where_its_agent_was_silent_never_a_zero(running):
    session = running()
    now = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(sample(session, now - 100, gpu_memory=GiB),
                                             sample(session, now - 95, gpu_memory=2 * GiB),
                                             sample(session, now - 10, gpu_memory=3 * GiB)))

    series = selectors.session_series(session=session, since=now - 200, until=now + 1)

    assert series["gpu_memory"] == [GiB, 2 * GiB, None, 3 * GiB]
    assert series["t"] == [now - 100, now - 95, now - 94, now - 10]
    assert series["resolution"] == "raw" and series["gpu_memory_limit"] == 2 * GiB  # 0.5 fGPU of 4 GiB


# --- accounting ------------------------------------------------------------------------------------

FROM = datetime(2026, 3, 1, tzinfo=dt_timezone.utc)


def held(session, *, start: datetime, seconds: float, memory: int, shares: str, device=None):
    """An allocation of `session` held from `start` for `seconds` (released then)."""
    allocation = Allocation.objects.create(session=session, device=device or demo_cluster_device(),
                                           shares=Decimal(shares), memory=memory, procs=Decimal(0))
    Allocation.objects.filter(pk=allocation.pk).update(created_at=start, released_at=start + timedelta(seconds=seconds))


def ended_session(owner, name="job"):
    session = ComputeSession.objects.create(owner=owner, name=name, status=SessionStatus.TERMINATED,
                                            node=demo_cluster_device().node)
    return session


@pytest.fixture
def ledger(demo_cluster, alice, bob):
    """alice (projects vision and nlp): a 0.5 fGPU (2 GiB of the 8 GiB GPU) session for 1 h 30 min
    and a whole GPU for 45 min 7 s; bob (project nlp): 0.25 fGPU (1 GiB) for 2 h 0 min 1 s, of
    which only the part in March counts (it started 30 min before)."""
    vision, nlp = Project.objects.create(name="vision"), Project.objects.create(name="nlp")
    vision.members.add(alice)
    nlp.members.add(alice, bob)
    a1, a2, b1 = ended_session(alice, "a1"), ended_session(alice, "a2"), ended_session(bob, "b1")
    held(a1, start=FROM + timedelta(hours=1), seconds=5400, memory=2 * GiB, shares="0.5")
    held(a2, start=FROM + timedelta(days=2), seconds=2707, memory=8 * GiB, shares="2")
    held(b1, start=FROM - timedelta(minutes=30), seconds=7201, memory=1 * GiB, shares="0.25")
    return {"a1": a1, "a2": a2, "b1": b1}


def rows_by_key(rows):
    return {row["key"]: row for row in rows}


def hours(seconds) -> str:
    return str((Decimal(seconds) / 3600).quantize(Decimal("0.000001")))


def test_gpu_hours_fgpu_hours_and_memory_hours_per_user_equal_the_hand_computed_sums(ledger, staff):
    rows = rows_by_key(selectors.usage_report(user=staff, start=FROM, end=FROM + timedelta(days=31), group_by="user"))

    # alice: 5400 s × 2/8 of the GPU + 2707 s × 1 GPU; bob: (7201 − 1800) s × 1/8
    assert rows["alice"]["gpu_hours"] == hours(Decimal(5400) / 4 + 2707)
    assert rows["alice"]["fgpu_hours"] == hours(Decimal(5400) * Decimal("0.5") + 2707 * 2)
    assert rows["alice"]["gpu_memory_gib_hours"] == hours(5400 * 2 + 2707 * 8)
    assert rows["bob"]["gpu_hours"] == hours(Decimal(5401) / 8)
    assert rows["bob"]["fgpu_hours"] == hours(Decimal(5401) / 4)
    assert (rows["alice"]["sessions"], rows["bob"]["sessions"]) == (2, 1)


def test_by_project_a_member_of_two_projects_counts_in_both_and_by_node_everything_is_on_its_node(ledger, staff):
    by_project = rows_by_key(selectors.usage_report(user=staff, start=FROM, end=FROM + timedelta(days=31),
                                                    group_by="project"))
    by_node = rows_by_key(selectors.usage_report(user=staff, start=FROM, end=FROM + timedelta(days=31),
                                                 group_by="node"))

    assert by_project["vision"]["fgpu_hours"] == hours(Decimal(5400) / 2 + 2707 * 2)
    assert by_project["nlp"]["fgpu_hours"] == hours(Decimal(5400) / 2 + 2707 * 2 + Decimal(5401) / 4)
    assert by_node[NODE]["sessions"] == 3 and set(by_node) == {NODE}


def test_a_range_cuts_allocations_to_the_second_and_a_user_sees_only_their_own(ledger, bob):
    rows = selectors.usage_report(user=bob, start=FROM, end=FROM + timedelta(minutes=10, seconds=1), group_by="user")

    assert rows == [{"key": "bob", "gpu_hours": hours(Decimal(601) / 8), "fgpu_hours": hours(Decimal(601) / 4),
                     "gpu_memory_gib_hours": hours(601), "used_gpu_hours": hours(0),
                     "used_gpu_memory_gib_hours": hours(0), "sessions": 1}]


def test_used_hours_add_the_5_minute_sums_before_the_watermark_and_the_samples_after_it(running, staff):
    session = running()
    now = int(time.time())
    mark = now // 300 * 300 - 600
    RollupState.objects.create(pk=1, watermark=mark)
    SessionRollup.objects.create(session=session, bucket=mark - 300, samples=60, span_s=300, gpu_span_s=300,
                                 gpu_memory_s=300 * 2 * GiB, gpu_util_s=300 * 50)
    SessionSample.objects.create(session=session, t=mark + 5, span=3600, gpu_memory=GiB, gpu_util=100)
    start = datetime.fromtimestamp(mark - 3600, dt_timezone.utc)

    row = selectors.usage_report(user=staff, start=start, end=start + timedelta(hours=2), group_by="user")[0]

    assert row["used_gpu_memory_gib_hours"] == hours(300 * 2 + 3600)
    assert row["used_gpu_hours"] == hours(150 + 3600)


# --- the API, its CSV, the CLI --------------------------------------------------------------------------

def test_the_usage_api_answers_json_and_csv_and_refuses_bad_parameters_by_name(ledger, alice, staff):
    api = client_for(staff)
    query = {"from": "2026-03-01", "to": "2026-04-01", "group_by": "project"}

    body = api.get("/api/v1/usage/", query).json()
    as_csv = api.get("/api/v1/usage/", {**query, "format": "csv"})
    mine = client_for(alice).get("/api/v1/usage/", {**query, "group_by": "user"}).json()

    assert (body["from"], body["to"], body["group_by"]) == ("2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z", "project")
    assert [r["key"] for r in body["rows"]] == ["nlp", "vision"]
    assert as_csv["Content-Type"].startswith("text/csv") and "attachment" in as_csv["Content-Disposition"]
    lines = as_csv.content.decode().splitlines()
    assert lines[0] == "project,gpu_hours,fgpu_hours,gpu_memory_gib_hours,used_gpu_hours,used_gpu_memory_gib_hours,sessions"
    assert lines[1].startswith("nlp,") and len(lines) == 3
    assert [r["key"] for r in mine["rows"]] == ["alice"]
    for bad, field in (({"from": "yesterday"}, "from"), ({"group_by": "team"}, "group_by"),
                       ({"from": "2026-03-02", "to": "2026-03-01"}, "to"), ({"from": "2020-01-01"}, "from")):
        answer = api.get("/api/v1/usage/", {**query, **bad})
        assert answer.status_code == 400 and field in answer.json()["field_errors"], bad


def test_a_sessions_usage_history_is_its_owners_and_admins_only(running, bob, staff):
    session = running()
    now = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(sample(session, now - 5)))

    mine = client_for(session.owner).get(f"/api/v1/sessions/{session.pk}/usage/")
    theirs = client_for(bob).get(f"/api/v1/sessions/{session.pk}/usage/")

    assert mine.status_code == 200 and mine.json()["gpu_memory"] == [GiB]
    assert client_for(staff).get(f"/api/v1/sessions/{session.pk}/usage/").status_code == 200
    assert theirs.status_code == 404
    assert client_for(session.owner).get(f"/api/v1/sessions/{session.pk}/usage/", {"since": "x"}).status_code == 400


def test_fgpu_usage_prints_the_report_as_a_table_and_as_csv(ledger):
    from fgpu_cli.usage import usage_csv, usage_text

    report = {"from": "2026-03-01T00:00:00Z", "to": "2026-04-01T00:00:00Z", "group_by": "project",
              "rows": selectors.usage_report(user=ledger["a1"].owner, start=FROM, end=FROM + timedelta(days=31),
                                             group_by="project")}

    text = usage_text(report)
    assert text.splitlines()[1].split()[:3] == ["PROJECT", "GPU-H", "FGPU-H"]
    assert "vision" in text and "nlp" in text
    assert usage_csv(report).splitlines()[1].startswith("nlp,")


# --- /metrics -------------------------------------------------------------------------------------

def test_metrics_are_off_without_a_token_and_need_the_right_bearer_token(demo_cluster):
    from rest_framework.test import APIClient

    web = APIClient()
    with override_settings(FGPU_METRICS_TOKEN=""):
        assert web.get("/metrics").status_code == 404
    with override_settings(FGPU_METRICS_TOKEN=TOKEN):
        assert web.get("/metrics").status_code == 401
        assert web.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong-token-0123456789").status_code == 401
        assert web.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200


def scrape() -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    from rest_framework.test import APIClient

    with override_settings(FGPU_METRICS_TOKEN=TOKEN):
        text = APIClient().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


def test_metrics_show_devices_sessions_nodes_and_the_scheduler_under_dcgm_and_hami_names(running):
    session, idle = running(), running()
    now = int(time.time())
    uuid = mock_gpu(0).device_id
    usage_ingest(node_name=NODE, batch=batch(
        sample(session, now - 10, gpu_memory=GiB), sample(session, now - 5, gpu_memory=3 * GiB, gpu_util=80),
        sample(idle, now - 5, gpu_memory=0, gpu_util=0),
        devices=[{"device": uuid, "t": now - 5, "memory_used": 3 * GiB, "memory_total": 8 * GiB, "util": 80}]))

    m = scrape()

    device = f"Hostname={NODE},UUID={uuid},gpu=0,modelName=CUDA GPU"
    assert (m[f"DCGM_FI_DEV_FB_USED{{{device}}}"], m[f"DCGM_FI_DEV_FB_FREE{{{device}}}"]) == (3072, 5120)
    assert m[f"DCGM_FI_DEV_GPU_UTIL{{{device}}}"] == 80
    labels = f"node={NODE},session={session.pk},session_name={session.name},user=alice"
    assert m[f"vGPU_device_memory_usage_in_bytes{{{labels}}}"] == 3 * GiB  # the newest sample
    assert m[f"vGPU_device_memory_limit_in_bytes{{{labels}}}"] == 2 * GiB
    assert m[f"Device_utilization_desc_of_container{{{labels}}}"] == 80
    assert m[f"fgpu_session_granted_fgpu{{{labels}}}"] == 0.5
    assert m[f"vGPU_device_memory_usage_in_bytes{{node={NODE},session={idle.pk},session_name={idle.name},user=alice}}"] == 0
    assert (m[f"fgpu_node_free_fgpu{{node={NODE}}}"], m[f"fgpu_node_capacity_fgpu{{node={NODE}}}"]) == (1.0, 2.0)
    assert m["fgpu_scheduler_pending_sessions{}"] == 0
    assert m["fgpu_scheduler_placement_latency_seconds_count{}"] == 2
    assert m["fgpu_session_launches_total{outcome=started}"] == 2


# --- idle reclamation --------------------------------------------------------------------------------

@pytest.fixture
def policy(db):
    return IdlePolicy.objects.create(resource_group=None, gpu_util_threshold=1, idle_timeout=600, grace=60)


def quiet(session, *, util=0, last_input=None, until=None):
    """Samples every 5 s over the last 10 minutes at `util` percent."""
    end = until or int(time.time())
    usage_ingest(node_name=NODE, batch=batch(*(sample(session, t, gpu_util=util, last_input=last_input)
                                               for t in range(end - 600, end, 5))))


def test_an_idle_session_is_warned_in_its_terminal_and_page_then_terminated_with_the_reason(running, policy, agent):
    session = running(age=900)
    quiet(session)
    now = timezone.now()

    warned = usage_idle_check(now=now)
    activity = SessionActivity.objects.get(session=session)
    not_yet = usage_idle_check(now=now + timedelta(seconds=30))
    done = usage_idle_check(now=now + timedelta(seconds=61))

    assert warned["warned"] == [str(session.pk)] and not_yet == {"warned": [], "terminated": [], "cleared": []}
    assert activity.reason == "idle for 10 min (GPU utilisation < 1 %)"
    assert activity.deadline == now + timedelta(seconds=60)
    assert agent.notices[0][0] == str(session.pk) and "will be terminated at" in agent.notices[0][1]
    assert done["terminated"] == [str(session.pk)] and agent.stops == [str(session.pk)]
    services.session_report_apply(session_id=str(session.pk), status="TERMINATED", reason="terminated", exit_code=0)
    session.refresh_from_db()
    assert (session.status, session.status_reason) == (
        "TERMINATED", "reclaimed: idle for 10 min (GPU utilisation < 1 %)")


def test_terminal_input_a_busy_gpu_a_batch_session_or_a_silent_agent_keep_a_session(running, policy, bob):
    typed = running(age=900)
    busy = running(age=900)
    batch_job = running(command="sleep 1000", age=900)
    silent = running(age=900)
    now = int(time.time())
    quiet(typed, last_input=now - 60)
    quiet(busy, util=35)
    quiet(batch_job)

    assert usage_idle_check()["warned"] == []
    assert not SessionActivity.objects.filter(deadline__isnull=False).exists()
    assert silent.status == "RUNNING"


def test_a_warned_session_that_gets_busy_again_loses_its_warning(running, policy, agent):
    session = running(age=900)
    quiet(session)
    assert usage_idle_check()["warned"] == [str(session.pk)]
    usage_ingest(node_name=NODE, batch=batch(sample(session, int(time.time()) + 1, last_input=int(time.time()))))

    assert usage_idle_check()["cleared"] == [str(session.pk)]
    assert SessionActivity.objects.get(session=session).deadline is None


def test_a_session_past_its_groups_maximum_lifetime_is_warned_then_terminated_even_in_batch(running, agent, db):
    IdlePolicy.objects.create(resource_group=None, max_lifetime=3600, grace=60)
    old, young = running(command="train", age=3560), running(age=100)
    now = timezone.now()

    assert usage_idle_check(now=now)["warned"] == [str(old.pk)]
    assert usage_idle_check(now=now + timedelta(seconds=61))["terminated"] == [str(old.pk)]
    old.refresh_from_db()
    assert old.status_reason == "reclaimed: reached its maximum lifetime of 1 h"
    assert young.pk not in {s for s in agent.stops}


def test_the_usage_report_task_refuses_a_batch_whose_signature_does_not_verify(running):
    import protocol
    from accelerators.models import Node
    from usage.tasks import usage_report

    session = running()
    Node.objects.filter(name=NODE).update(agent_key="k" * 32)
    body = batch(sample(session, int(time.time()))).encode()["batch"]

    forged = usage_report(node=NODE, batch=body, signature="0" * 64)
    signed = usage_report(node=NODE, batch=body, signature=protocol.sign("k" * 32, protocol.USAGE_REPORT,
                                                                         {"node": NODE, "batch": body}))

    assert forged["refused"] == {"not authentic": 1} and signed["stored"] == 1
