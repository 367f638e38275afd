"""Writes of usage: storing the agents' samples, rolling them up into 5-minute means with
retention, and idle reclamation (issue 15). Reads are in usage.selectors."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Max, Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from accelerators.models import Device, Node
from protocol.messages import DATA_FOLDER, PROJECT_FOLDER, UsageBatch
from sessions.models import ComputeSession, Project, SessionStatus
from sessions.lifecycle.reconcile import valid_uuids
from usage.models import (
    DeviceRollup,
    DeviceSample,
    FolderUse,
    IdlePolicy,
    RollupState,
    SessionActivity,
    SessionPeriodRollup,
    SessionRollup,
    SessionSample,
)

log = logging.getLogger(__name__)

BUCKET = 300  # seconds in one rollup bucket
PERIOD_BACKFILL = 31 * 86400  # seconds of hours or days one rollup run writes at most per level (a first run
#                               after an upgrade, over 90 days of 5-minute rollups, is spread over three runs)


def _now() -> float:
    return time.time()


@dataclass
class IngestResult:
    """What `usage_ingest` did with one batch: samples `stored`, `duplicates` (already stored),
    `refused` with the reason of each kind (`{"unknown session": 2, …}`)."""

    stored: int = 0
    duplicates: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1


def _watermark() -> int:
    return RollupState.objects.values_list("watermark", flat=True).first() or 0


def usage_ingest(*, node_name: str, batch: UsageBatch) -> IngestResult:
    """Store one decoded batch of an agent's samples (protocol.messages.UsageBatch: the task
    decodes it, usage.tasks.usage_report), idempotently: (session, t) and (device, t) are stored
    once, whatever the order or number of deliveries. Refused, counted and logged, never raised:

    - "unknown session" / "unknown device": no such id, or not on `node_name`;
    - "session ended": a sample taken after its session ended (its terminated_at), or of a session
      that never ran (PENDING, CANCELLED);
    - "too late": older than the rollup watermark (its 5-minute bucket is closed, FGPU_USAGE_LATENESS);
    - "from the future": more than 5 minutes ahead of the manager's clock;
    - "malformed": the samples the decoder left out (`batch.malformed`: a field of the wrong type or
      out of range, bytes ≥ 0, percent 0–100).

    Also moves each session's SessionActivity (last input, last sample) on, and keeps the newest
    figures of the data folders the samples name (FolderUse, `_folder_note`).
    """
    result = IngestResult()
    for _ in range(batch.malformed):
        result.refuse("malformed")
    horizon, future = _watermark(), int(_now()) + 300

    def timely(t) -> bool:
        if t < horizon:
            result.refuse("too late")
            return False
        if t > future:
            result.refuse("from the future")
            return False
        return True

    ids = {row.session_id for row in batch.sessions}
    known = {
        str(s["id"]): s
        for s in ComputeSession.objects.filter(pk__in=valid_uuids(list(ids)), node__name=node_name).values(
            "id", "status", "started_at", "terminated_at", "owner_id"
        )
    }
    rows: list[SessionSample] = []
    folders: dict[tuple[int, str], tuple[int, int, int]] = {}  # (owner id, "~/data" …) → newest (t, used, limit)
    activity: dict[str, list] = {}  # session id → [last input or None, last sample] (Unix s)
    for row in batch.sessions:
        sid, t = row.session_id, row.t
        session = known.get(sid)
        if session is None:
            result.refuse("unknown session")
            continue
        ended = session["terminated_at"]
        if session["status"] in (SessionStatus.PENDING, SessionStatus.CANCELLED) or (ended is not None and t > ended.timestamp()):
            result.refuse("session ended")
            continue
        if not timely(t):
            continue
        rows.append(
            SessionSample(
                session_id=sid,
                t=t,
                span=row.span,
                gpu_memory=row.gpu_memory,
                gpu_util=row.gpu_util,
                cpu=row.cpu,
                mem=row.mem,
                storage=row.storage,
                storage_limit=row.storage_limit,
            )
        )
        for measured in row.folders:
            key = (session["owner_id"], measured.folder)
            if key not in folders or folders[key][0] < t:
                folders[key] = (t, measured.used, measured.limit)
        seen = activity.setdefault(sid, [None, None])
        seen[0] = max(filter(None, (seen[0], row.last_input)), default=None)
        seen[1] = max(seen[1] or 0, t)
    devices = dict(Device.objects.filter(node__name=node_name).values_list("device_id", "id"))
    device_rows: list[DeviceSample] = []
    for device in batch.devices:
        device_id = devices.get(device.device)
        if device_id is None:
            result.refuse("unknown device")
            continue
        if timely(device.t):
            device_rows.append(
                DeviceSample(
                    device_id=device_id,
                    t=device.t,
                    memory_used=device.memory_used,
                    memory_total=device.memory_total,
                    util=device.util,
                )
            )
    with transaction.atomic():
        stored = _insert(SessionSample, rows) + _insert(DeviceSample, device_rows)
        for session_id, (last_input, last_sample) in activity.items():
            _activity_note(session_id, last_input=last_input, last_sample=last_sample)
        if folders:
            _folder_note(node_name=node_name, folders=folders)
    result.stored = stored
    result.duplicates = len(rows) + len(device_rows) - stored
    if result.refused:
        log.warning("usage batch from node %s: refused %s", node_name, result.refused)
    return result


def _folder_note(*, node_name: str, folders: dict[tuple[int, str], tuple[int, int, int]]) -> None:
    """Keep each folder's newest figures (FolderUse): `~/data` is its session owner's; `~/projects/<name>`
    the project of that name, only where the owner is a member (a node reports only for its sessions'
    folders, and those are the only ones it mounts). An older figure never replaces a newer one."""
    node_id = Node.objects.filter(name=node_name).values_list("id", flat=True).first()
    if node_id is None:  # the samples were accepted for sessions on it, so it existed a moment ago
        return
    names = {name.removeprefix(PROJECT_FOLDER) for _, name in folders if name != DATA_FOLDER}
    projects = {
        (owner_id, name): project_id
        for owner_id, name, project_id in Project.members.through.objects.filter(project__name__in=names).values_list(
            "user_id", "project__name", "project_id"
        )
    }
    for (owner_id, name), (t, used, limit) in folders.items():
        subject: dict[str, object]
        if name == DATA_FOLDER:
            subject = {"owner_id": owner_id, "project_id": None}
        elif (owner_id, name.removeprefix(PROJECT_FOLDER)) in projects:
            subject = {"owner_id": None, "project_id": projects[(owner_id, name.removeprefix(PROJECT_FOLDER))]}
        else:
            continue  # a project the owner left, or one renamed meanwhile
        figures = {"used": used, "limit": limit, "t": t}
        if not FolderUse.objects.filter(node_id=node_id, **subject, t__lt=t).update(**figures):
            FolderUse.objects.get_or_create(node_id=node_id, **subject, defaults=figures)


def _insert(model, rows: list) -> int:
    """Insert `rows`, skipping those whose (owner, t) is stored already; how many were new."""
    if not rows:
        return 0
    key = "session_id" if model is SessionSample else "device_id"
    unique = {(getattr(r, key), r.t): r for r in rows}  # one per key within the batch too
    before = model.objects.filter(**{f"{key}__in": {k for k, _ in unique}}, t__in={t for _, t in unique}).count()
    model.objects.bulk_create(list(unique.values()), ignore_conflicts=True, batch_size=2000)
    after = model.objects.filter(**{f"{key}__in": {k for k, _ in unique}}, t__in={t for _, t in unique}).count()
    return after - before


def _activity_note(session_id: str, *, last_input: int | None, last_sample: int) -> None:
    # django-stubs want a UUID where Django takes its text too.
    activity, _ = SessionActivity.objects.select_for_update().get_or_create(session_id=session_id)  # type: ignore[misc]
    fields = []
    if last_input is not None and (activity.last_input or 0) < last_input:
        activity.last_input = last_input
        fields.append("last_input")
    if (activity.last_sample or 0) < last_sample:
        activity.last_sample = last_sample
        fields.append("last_sample")
    if fields:
        activity.save(update_fields=fields)


# --- rollup and retention ----------------------------------------------------------------------


def usage_rollup(*, now: float | None = None) -> dict:
    """Roll full-resolution samples up into 5-minute buckets, up to the new watermark
    (now − FGPU_USAGE_LATENESS, rounded down to a bucket); sum the closed buckets into hourly and
    the closed hours into daily SessionPeriodRollup rows (at most PERIOD_BACKFILL seconds of each
    level per run); then apply retention: samples older than FGPU_USAGE_RAW_RETENTION, rollups and
    periods older than FGPU_USAGE_ROLLUP_RETENTION are deleted. Idempotent and safe to run twice
    at once or after a crash: RollupState is locked for the run, each bucket or period is computed
    from all its sources and upserted, and the watermarks move in the same transaction as the rows
    they vouch for. Returns `{"watermark", "hour_watermark", "day_watermark", "session_buckets",
    "device_buckets", "hours", "days", "deleted_samples", "deleted_rollups"}`."""
    now = _now() if now is None else now
    new_mark = int(now - settings.FGPU_USAGE_LATENESS) // BUCKET * BUCKET
    with transaction.atomic():
        state, _ = RollupState.objects.select_for_update().get_or_create(pk=1)
        start = state.watermark or _first_sample_bucket(new_mark)
        session_buckets = device_buckets = 0
        if new_mark > start:
            session_buckets = _roll_sessions(start, new_mark)
            device_buckets = _roll_devices(start, new_mark)
            state.watermark = new_mark
        periods = _roll_periods(state)
        state.save(update_fields=["watermark", "hour_watermark", "day_watermark"])
    raw_horizon = int(now - settings.FGPU_USAGE_RAW_RETENTION)
    raw_horizon = min(raw_horizon, state.watermark)  # never delete what is not rolled up yet
    deleted_samples = (
        SessionSample.objects.filter(t__lt=raw_horizon).delete()[0] + DeviceSample.objects.filter(t__lt=raw_horizon).delete()[0]
    )
    rollup_horizon = int(now - settings.FGPU_USAGE_ROLLUP_RETENTION)
    deleted_rollups = (
        SessionRollup.objects.filter(bucket__lt=rollup_horizon).delete()[0]
        + DeviceRollup.objects.filter(bucket__lt=rollup_horizon).delete()[0]
        + SessionPeriodRollup.objects.filter(start__lt=rollup_horizon).delete()[0]
    )
    return {
        "watermark": state.watermark,
        "hour_watermark": state.hour_watermark,
        "day_watermark": state.day_watermark,
        "session_buckets": session_buckets,
        "device_buckets": device_buckets,
        **periods,
        "deleted_samples": deleted_samples,
        "deleted_rollups": deleted_rollups,
    }


def _roll_periods(state: RollupState) -> dict:
    """Move `state.hour_watermark` and `state.day_watermark` on (not saved): hours from the
    5-minute rollups closed before `state.watermark`, days from the hours closed before the hour
    watermark. A level with no mark yet starts at its source's first row. Returns `{"hours": rows
    written, "days": rows written}`."""
    written = {}
    source_mark = state.watermark
    for width, mark_field, name in (
        (SessionPeriodRollup.HOUR, "hour_watermark", "hours"),
        (SessionPeriodRollup.DAY, "day_watermark", "days"),
    ):
        target = source_mark // width * width
        mark = getattr(state, mark_field) or _first_period(width, target)
        end = min(target, mark + PERIOD_BACKFILL)
        written[name] = _roll_period(width, mark, end) if end > mark else 0
        setattr(state, mark_field, max(end, mark))
        source_mark = getattr(state, mark_field)
    return written


def _period_source(width: int) -> tuple[str, str, str]:
    """(table, time column, extra condition) a period of `width` seconds is summed from."""
    if width == SessionPeriodRollup.HOUR:
        return SessionRollup._meta.db_table, "bucket", ""
    return SessionPeriodRollup._meta.db_table, "start", f"AND width = {SessionPeriodRollup.HOUR}"


def _first_period(width: int, default: int) -> int:
    table, column, extra = _period_source(width)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT MIN({column}) FROM {table} WHERE {column} < %s {extra}", [default])
        first = cursor.fetchone()[0]
    return default if first is None else first // width * width


def _roll_period(width: int, start: int, end: int) -> int:
    """Upsert the periods of `width` seconds in [start, end) (multiples of width) from their
    sources, in one statement (INSERT … SELECT … ON CONFLICT, PostgreSQL and SQLite alike).
    Returns the rows written."""
    table, column, extra = _period_source(width)
    sums = ("samples", "span_s", "gpu_memory_s", "gpu_util_s", "gpu_span_s", "cpu_s")
    maxima = ("gpu_memory_max", "gpu_util_max", "mem_max")
    period = f"{column} - {column} %% {int(width)}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {SessionPeriodRollup._meta.db_table} (session_id, width, start, {', '.join(sums + maxima)}) "
            f"SELECT session_id, {int(width)}, {period}, {', '.join(f'SUM({c})' for c in sums)}, "
            f"{', '.join(f'MAX({c})' for c in maxima)} FROM {table} WHERE {column} >= %s AND {column} < %s {extra} "
            f"GROUP BY session_id, {period} "
            f"ON CONFLICT (session_id, width, start) DO UPDATE SET "
            f"{', '.join(f'{c} = excluded.{c}' for c in sums + maxima)}",
            [start, end],
        )
        return cursor.rowcount


def _first_sample_bucket(default: int) -> int:
    first = min(
        filter(
            None,
            (
                SessionSample.objects.order_by("t").values_list("t", flat=True).first(),
                DeviceSample.objects.order_by("t").values_list("t", flat=True).first(),
            ),
        ),
        default=None,
    )
    return default if first is None else first // BUCKET * BUCKET


def _roll_sessions(start: int, end: int) -> int:
    known_gpu = Q(gpu_memory__isnull=False)
    rows = (
        SessionSample.objects.filter(t__gte=start, t__lt=end)
        .annotate(b=F("t") - F("t") % BUCKET)
        .values("session_id", "b")
        .annotate(
            samples=Count("id"),
            span_s=Sum("span"),
            gpu_memory_s=Coalesce(Sum(F("gpu_memory") * F("span"), filter=known_gpu), 0),
            gpu_memory_max=Max("gpu_memory"),
            gpu_util_s=Coalesce(Sum(F("gpu_util") * F("span"), filter=Q(gpu_util__isnull=False)), 0),
            gpu_util_max=Max("gpu_util"),
            gpu_span_s=Coalesce(Sum("span", filter=known_gpu), 0),
            cpu_s=Coalesce(Sum(F("cpu") * F("span"), filter=Q(cpu__isnull=False)), 0),
            mem_max=Max("mem"),
        )
    )
    # values() rows are plain dicts; django-stubs type them as TypedDicts whose keys cannot be popped.
    objs = [SessionRollup(session_id=r.pop("session_id"), bucket=r.pop("b"), **r) for r in rows]  # type: ignore[misc]
    SessionRollup.objects.bulk_create(
        objs,
        batch_size=2000,
        update_conflicts=True,
        unique_fields=["session", "bucket"],
        update_fields=[
            "samples",
            "span_s",
            "gpu_memory_s",
            "gpu_memory_max",
            "gpu_util_s",
            "gpu_util_max",
            "gpu_span_s",
            "cpu_s",
            "mem_max",
        ],
    )
    return len(objs)


def _roll_devices(start: int, end: int) -> int:
    from django.db.models import Avg

    rows = (
        DeviceSample.objects.filter(t__gte=start, t__lt=end)
        .annotate(b=F("t") - F("t") % BUCKET)
        .values("device_id", "b")
        .annotate(
            samples=Count("id"),
            memory_used_avg=Avg("memory_used"),
            memory_used_max=Max("memory_used"),
            memory_total=Max("memory_total"),
            util_avg=Avg("util"),
        )
    )
    objs = [
        DeviceRollup(
            device_id=r["device_id"],
            bucket=r["b"],
            samples=r["samples"],
            memory_used_avg=int(r["memory_used_avg"]),
            memory_used_max=r["memory_used_max"],
            memory_total=r["memory_total"],
            util_avg=None if r["util_avg"] is None else int(round(r["util_avg"])),
        )
        for r in rows
    ]
    DeviceRollup.objects.bulk_create(
        objs,
        batch_size=2000,
        update_conflicts=True,
        unique_fields=["device", "bucket"],
        update_fields=["samples", "memory_used_avg", "memory_used_max", "memory_total", "util_avg"],
    )
    return len(objs)


# --- idle reclamation ---------------------------------------------------------------------------


def _policy_for(session: ComputeSession, policies: dict) -> IdlePolicy | None:
    group = session.node.resource_group_id if session.node else None
    return policies.get(group)


def usage_idle_check(*, now: datetime | None = None) -> dict:
    """Warn, then terminate, running sessions their resource group's IdlePolicy reclaims:

    - idle: interactive (no command), running at least `idle_timeout`, every sample of the last
      `idle_timeout` seconds under `gpu_util_threshold` percent (and samples cover that window:
      an agent that sent nothing is no proof of idleness), and no terminal input in it;
    - lifetime: running longer than `max_lifetime`.

    A session found reclaimable is warned first (its terminal gets a line, its page the reason
    and `deadline`): an idle one `grace` seconds ahead, unless it is used again; one near its
    maximum lifetime `grace` seconds before it ends (at once when the lifetime is shorter than
    the grace), its deadline being that end, `started_at + max_lifetime`, whatever the grace
    (issue 36.3: a 60 s lifetime with 120 s grace ran 125 s); of both, the earlier deadline and
    its reason are the warning. One still reclaimable at its deadline is terminated
    with the reason ("idle for 2 h (GPU utilisation < 1 %)", "reached its maximum lifetime of
    8 h") by the first check at or after it (the beat runs it every 30 s); one that became busy
    again loses its idle warning. Returns `{"warned": [ids], "terminated": [ids], "cleared": [ids]}`."""
    from sessions.lifecycle.services import RECLAIMED, session_terminate

    now = now or timezone.now()
    policies = {p.resource_group_id: p for p in IdlePolicy.objects.all()}
    out: dict[str, list[str]] = {"warned": [], "terminated": [], "cleared": []}
    if not policies:
        return out
    running = ComputeSession.objects.filter(status=SessionStatus.RUNNING).select_related("node")
    for session in running:
        policy = _policy_for(session, policies)
        if policy is None:
            continue
        activity = SessionActivity.objects.filter(session=session).first()
        warned = activity.deadline if activity is not None else None
        candidates = []  # (deadline, reason, is the lifetime)
        lifetime = _lifetime_end(session, policy, now)
        if lifetime is not None:
            candidates.append((lifetime[1], lifetime[0], True))
        idle = _idle_reason(session, policy, now)
        if idle is not None:
            kept = warned is not None and activity is not None and activity.reason == idle  # warned of it already
            candidates.append((warned if kept and warned is not None else now + timedelta(seconds=policy.grace), idle, False))
        if not candidates:
            if warned is not None:
                SessionActivity.objects.filter(session=session).update(deadline=None, reason="")
                _notify(session, "no longer idle: the warning is withdrawn")
                out["cleared"].append(str(session.pk))
            continue
        deadline, reason, is_lifetime = min(candidates)  # the earlier end wins
        if warned != deadline or activity is None or activity.reason != reason:
            SessionActivity.objects.update_or_create(session=session, defaults={"deadline": deadline, "reason": reason})
            at = f"{deadline.astimezone(dt_timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
            if is_lifetime:
                _notify(session, f"{reason}: this session will be terminated at {at}; save your work before then")
            else:
                _notify(session, f"{reason}: this session will be terminated at {at} unless it is used again")
            out["warned"].append(str(session.pk))
        elif deadline <= now:
            session_terminate(session=session, reason=f"{RECLAIMED}{reason}")
            out["terminated"].append(str(session.pk))
    return out


def _hours(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


def _lifetime_end(session: ComputeSession, policy: IdlePolicy, now: datetime) -> tuple[str, datetime] | None:
    """`(reason, end)` once `session` is within `grace` seconds of its maximum lifetime (from its
    start when the lifetime is the shorter), `end` being `started_at + max_lifetime`; else None."""
    started = session.started_at
    if started is None or policy.max_lifetime is None:
        return None
    if (now - started).total_seconds() < policy.max_lifetime - policy.grace:
        return None
    return f"reached its maximum lifetime of {_hours(policy.max_lifetime)}", started + timedelta(seconds=policy.max_lifetime)


def _idle_reason(session: ComputeSession, policy: IdlePolicy, now: datetime) -> str | None:
    """Why `session` is idle at `now` under `policy` ("idle for 10 min (GPU utilisation < 1 %)"),
    or None: a batch session, too young, terminal input or a busy sample within `idle_timeout`
    seconds, or too few samples to tell."""
    started = session.started_at
    if started is None:
        return None
    age = (now - started).total_seconds()
    if policy.idle_timeout is None or session.command or age < policy.idle_timeout:
        return None
    since = int(now.timestamp()) - policy.idle_timeout
    last_input = SessionActivity.objects.filter(session=session).values_list("last_input", flat=True).first()
    if (last_input or 0) >= since:
        return None
    window = SessionSample.objects.filter(session=session, t__gte=since).aggregate(
        busiest=Max("gpu_util"), unknown=Count("id", filter=Q(gpu_util__isnull=True)), covered=Sum("span")
    )
    if not window["covered"] or window["covered"] < policy.idle_timeout // 2 or window["unknown"]:
        return None  # too few samples to call it idle (the agent was silent, or the figures unknown)
    if window["busiest"] is not None and window["busiest"] >= policy.gpu_util_threshold:
        return None
    return f"idle for {_hours(policy.idle_timeout)} (GPU utilisation < {policy.gpu_util_threshold} %)"


def _notify(session: ComputeSession, text: str) -> None:
    """The warning in the session's terminal and on its page (`sessions.lifecycle.services.session_notice`)."""
    from sessions.lifecycle.services import session_notice

    session_notice(session, text)
