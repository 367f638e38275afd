"""Reads of usage: accounting (GPU-hours per user, project or node), a session's or device's
history for charts, and what /metrics exports (issue 15)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID
from datetime import datetime
from decimal import Decimal

from django.db.models import Avg, Count, F, Max, Q, Sum
from django.utils import timezone

from accelerators.fleet import DeviceSamples
from accelerators.models import Device
from sessions.models import Allocation, ComputeSession, Project
from sessions.usage_reads import IdleWatch, LifetimeBounds, UsageReads
from usage.models import (
    FolderUse,
    DeviceRollup,
    DeviceSample,
    IdlePolicy,
    RollupState,
    SessionActivity,
    SessionPeriodRollup,
    SessionRollup,
    SessionSample,
)

GiB = Decimal(1 << 30)
HOUR = Decimal(3600)
PLACES = Decimal("0.000001")  # hours to 6 decimals: 3.6 ms, so sums "to the second" compare exactly
GROUPS = ("user", "project", "node")
NO_PROJECT = ""  # the project key of sessions whose owner is in none


@dataclass
class UsageRow:
    """One line of the accounting report; hours as Decimal (6 places).

    `gpu_hours`: granted GPU-hours, each allocation's time × its fraction of the device's memory
    (1 for a whole device: Run:ai's GPU-hours of a fraction); `fgpu_hours`: granted fGPU × hours;
    `gpu_memory_gib_hours`: granted GiB × hours; `used_gpu_hours`: measured utilisation × hours
    (100 % for one hour = 1); `used_gpu_memory_gib_hours`: measured GiB × hours; `sessions`: how
    many sessions held or used something in the range."""

    key: str
    gpu_hours: Decimal = Decimal(0)
    fgpu_hours: Decimal = Decimal(0)
    gpu_memory_gib_hours: Decimal = Decimal(0)
    used_gpu_hours: Decimal = Decimal(0)
    used_gpu_memory_gib_hours: Decimal = Decimal(0)
    sessions: int = 0

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "gpu_hours": _q(self.gpu_hours),
            "fgpu_hours": _q(self.fgpu_hours),
            "gpu_memory_gib_hours": _q(self.gpu_memory_gib_hours),
            "used_gpu_hours": _q(self.used_gpu_hours),
            "used_gpu_memory_gib_hours": _q(self.used_gpu_memory_gib_hours),
            "sessions": self.sessions,
        }


def _q(value: Decimal) -> str:
    return str(value.quantize(PLACES))


def _seconds(delta) -> Decimal:
    """A timedelta as exact Decimal seconds (microseconds kept)."""
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / Decimal(1_000_000)


def usage_report(*, user, start: datetime, end: datetime, group_by: str, now: datetime | None = None) -> list[dict]:
    """Accounting over [start, end) grouped by "user" (owner's username), "project" (each
    project the owner is a member of now: a session of a member of two projects counts in both;
    NO_PROJECT for owners in none) or "node". Granted figures come from the allocations (each
    from its created_at to its released_at, or `now` while held), used figures from the samples
    (full resolution past the watermark; before it the daily, hourly and 5-minute sums of the
    whole days, hours and buckets inside the range, `_used`). `user`:
    staff see everyone's sessions, others their own. Returns UsageRow.as_dict() rows sorted by
    key. Raises ValueError for an unknown `group_by` or end ≤ start."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by: {group_by!r} is not one of {', '.join(GROUPS)}")
    if end <= start:
        raise ValueError("to must be after from")
    now = now or timezone.now()
    visible = Q() if user.is_staff else Q(session__owner=user)
    allocations = (
        Allocation.objects.filter(visible, created_at__lt=end)
        .filter(Q(released_at__isnull=True) | Q(released_at__gt=start))
        .values(
            "session_id",
            "session__owner_id",
            "session__owner__username",
            "device__node__name",
            "device__memory_size",
            "shares",
            "memory",
            "created_at",
            "released_at",
        )
    )
    session_keys: dict = {}
    rows: dict[str, UsageRow] = {}
    members = _projects_of_owners() if group_by == "project" else {}

    def keys_of(session_id, owner_id, username, node) -> list[str]:
        if group_by == "user":
            return [username]
        if group_by == "node":
            return [node or ""]
        return members.get(owner_id) or [NO_PROJECT]

    touched = collections.defaultdict(set)
    for a in allocations:
        held = _seconds(min(a["released_at"] or now, end, now) - max(a["created_at"], start))
        if held <= 0:
            continue
        keys = keys_of(a["session_id"], a["session__owner_id"], a["session__owner__username"], a["device__node__name"])
        session_keys.setdefault(a["session_id"], keys)
        fraction = Decimal(a["memory"]) / Decimal(a["device__memory_size"]) if a["device__memory_size"] else Decimal(1)
        for key in keys:
            row = rows.setdefault(key, UsageRow(key))
            row.gpu_hours += held * min(fraction, Decimal(1)) / HOUR
            row.fgpu_hours += held * a["shares"] / HOUR
            row.gpu_memory_gib_hours += held * Decimal(a["memory"]) / GiB / HOUR
            touched[key].add(a["session_id"])
    for session_id, (memory_s, util_s) in _used(visible_owner=None if user.is_staff else user, start=start, end=end).items():
        found = session_keys.get(session_id)
        if found is None:
            info = ComputeSession.objects.filter(pk=session_id).values("owner_id", "owner__username", "node__name").first()
            if info is None:
                continue
            found = keys_of(session_id, info["owner_id"], info["owner__username"], info["node__name"])
            session_keys[session_id] = found
        for key in found:
            row = rows.setdefault(key, UsageRow(key))
            row.used_gpu_memory_gib_hours += Decimal(memory_s) / GiB / HOUR
            row.used_gpu_hours += Decimal(util_s) / 100 / HOUR
            touched[key].add(session_id)
    for key, row in rows.items():
        row.sessions = len(touched[key])
    return [rows[key].as_dict() for key in sorted(rows)]


def _projects_of_owners() -> dict:
    out = collections.defaultdict(list)
    for owner_id, name in Project.members.through.objects.values_list("user_id", "project__name"):
        out[owner_id].append(name)
    return out


def _watermark() -> int:
    return RollupState.objects.values_list("watermark", flat=True).first() or 0


def _watermarks() -> tuple[int, int, int]:
    """(5-minute, hour, day) watermarks: buckets, hours and days before each are rolled up."""
    return RollupState.objects.values_list("watermark", "hour_watermark", "day_watermark").first() or (0, 0, 0)


def _ranges(t0: int, t1: int, *, hour_mark: int, day_mark: int) -> dict:
    """How [t0, t1) (epoch seconds) is read: `{86400: [(a, b)], 3600: [(a, b)], 300: [(lo, hi)]}`,
    whole closed days first, then whole closed hours in what is left, then the rest from the
    5-minute level (and the samples past its watermark). Periods are read where they lie wholly
    inside the range and before their level's watermark, so the coarse levels only ever replace
    5-minute buckets the range counts whole: the sums are those of the 5-minute level alone."""
    out: dict = {SessionPeriodRollup.DAY: [], SessionPeriodRollup.HOUR: [], 300: []}
    levels = ((SessionPeriodRollup.DAY, day_mark), (SessionPeriodRollup.HOUR, hour_mark))

    def cover(lo: int, hi: int, level: int) -> None:
        if lo >= hi:
            return
        if level == len(levels):
            out[300].append((lo, hi))
            return
        width, mark = levels[level]
        a, b = -(-lo // width) * width, min(hi, mark) // width * width
        if a >= b:
            cover(lo, hi, level + 1)
            return
        out[width].append((a, b))
        cover(lo, a, level + 1)
        cover(b, hi, level + 1)

    cover(t0, t1, 0)
    return out


def _used(*, visible_owner, start: datetime, end: datetime) -> dict:
    """{session id: (Σ GPU bytes × s, Σ percent × s)} over [start, end): daily and hourly sums
    (SessionPeriodRollup) for the whole closed days and hours inside the range, 5-minute sums for
    the other buckets before the watermark (those starting inside the range), full-resolution
    samples from it on. A month reads about 30 daily rows per session and at most a few dozen
    hourly and 5-minute ones (benchmarks/usage_query.py)."""
    t0, t1 = int(start.timestamp()), int(end.timestamp())
    mark, hour_mark, day_mark = _watermarks()
    owner = Q() if visible_owner is None else Q(session__owner=visible_owner)
    out: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def add(rows) -> None:
        for r in rows:
            out[r["session_id"]][0] += r["m"] or 0
            out[r["session_id"]][1] += r["u"] or 0

    ranges = _ranges(t0, t1, hour_mark=hour_mark, day_mark=day_mark)
    for width in (SessionPeriodRollup.DAY, SessionPeriodRollup.HOUR):
        if ranges[width]:
            within = Q()
            for a, b in ranges[width]:
                within |= Q(start__gte=a, start__lt=b)
            add(
                SessionPeriodRollup.objects.filter(owner, within, width=width)
                .values("session_id")
                .annotate(m=Sum("gpu_memory_s"), u=Sum("gpu_util_s"))
            )
    buckets = Q()
    for lo, hi in ranges[300]:
        if lo < mark:
            buckets |= Q(bucket__gte=lo, bucket__lt=min(hi, mark))
    if buckets:
        add(
            SessionRollup.objects.filter(owner, buckets).values("session_id").annotate(m=Sum("gpu_memory_s"), u=Sum("gpu_util_s"))
        )
    if t1 > mark:
        add(
            SessionSample.objects.filter(owner, t__gte=max(t0, mark), t__lt=t1)
            .values("session_id")
            .annotate(m=Sum(F("gpu_memory") * F("span")), u=Sum(F("gpu_util") * F("span")))
        )
    return {sid: tuple(v) for sid, v in out.items()}


# --- history for charts ---------------------------------------------------------------------------

SERIES_MAX_POINTS = 2000


def session_series(*, session: ComputeSession, since: int, until: int) -> dict:
    """A session's usage over [since, until) (epoch seconds) for a chart, column-wise:
    `{"t": [epoch s], "gpu_memory": [bytes|None], "gpu_util": [percent|None], "cpu": [milli-cores|None],
    "mem": [bytes|None], "resolution": "raw" | "5m" | "1h", "gpu_memory_limit": bytes granted (sum
    over devices), "deadline": ISO time or None, "deadline_reason": text, "storage": bytes in its home
    and container layer at its agent's newest measure, "storage_limit": bytes its agent enforces on
    that, "storage_t": epoch seconds of that sample (all three None before a first measure, and a day
    after the session's last sample: raw retention), whatever the range}`. Full-resolution samples
    while the range starts after the watermark (the last hour or so); else 5-minute means, or
    hourly means for a range longer than SERIES_MAX_POINTS 5-minute buckets (about a week: a
    month is 720 points), the newest of them (past the watermark) averaged from the samples as
    they stand. A gap (no sample for more than twice a point's span) is a None point, never a zero."""
    mark, hour_mark, _ = _watermarks()
    points: Iterable[tuple]
    if since >= mark:
        resolution = "raw"
        points = (
            SessionSample.objects.filter(session=session, t__gte=since, t__lt=until)
            .order_by("t")
            .values_list("t", "span", "gpu_memory", "gpu_util", "cpu", "mem")
        )
    else:
        long = until - since > SERIES_MAX_POINTS * 300 and since < hour_mark
        resolution, width = ("1h", SessionPeriodRollup.HOUR) if long else ("5m", 300)
        points = [
            (b, width, None if not g else m // g, None if not g else u // g, None if not s else c // s, x)
            for b, s, g, m, u, c, x in _rollup_points(
                session, since - since % width, until, width, hour_mark=hour_mark, mark=mark
            )
        ]
    names = ("t", "gpu_memory", "gpu_util", "cpu", "mem")
    rows = list(points)[-SERIES_MAX_POINTS:]
    columns = _columns(((t, g, u, c, m) for t, _, g, u, c, m in rows), names, [span for _, span, *_ in rows])
    limit = Allocation.objects.filter(session=session).aggregate(m=Sum("memory"))["m"] or 0
    activity = SessionActivity.objects.filter(session=session).values("deadline", "reason").first()
    deadline = activity["deadline"] if activity else None
    storage = (
        SessionSample.objects.filter(session=session, storage__isnull=False)
        .order_by("-t")
        .values_list("storage", "storage_limit", "t")
        .first()
    )
    return {
        **columns,
        **dict(zip(("storage", "storage_limit", "storage_t"), storage or (None, None, None))),
        "resolution": resolution,
        "gpu_memory_limit": limit,
        "deadline": deadline.isoformat() if deadline else None,
        "deadline_reason": activity["reason"] if activity else "",
    }


ROLLUP_POINT = ("span_s", "gpu_span_s", "gpu_memory_s", "gpu_util_s", "cpu_s", "mem_max")


def _rollup_points(session, since: int, until: int, width: int, *, hour_mark: int, mark: int) -> list[tuple]:
    """`(start, span_s, gpu_span_s, gpu_memory_s, gpu_util_s, cpu_s, mem_max)` per 5-minute bucket
    (`width` 300) or per hour (3600) in [since, until), by time: hourly rows before the hour
    watermark, the closed 5-minute buckets before the watermark, the samples past it (summed as
    a rollup sums them), each period's parts added up."""
    sources: list[Iterable[tuple]] = []
    if width == SessionPeriodRollup.HOUR:
        sources.append(
            SessionPeriodRollup.objects.filter(
                session=session, width=width, start__gte=since, start__lt=min(until, hour_mark)
            ).values_list("start", *ROLLUP_POINT)
        )
        since = max(since, hour_mark)
    period = F("bucket") - F("bucket") % width
    sources.append(
        SessionRollup.objects.filter(session=session, bucket__gte=since, bucket__lt=min(until, mark))
        .annotate(p=period)
        .values("p")
        .order_by("p")
        .annotate(
            a=Sum("span_s"), b=Sum("gpu_span_s"), c=Sum("gpu_memory_s"), d=Sum("gpu_util_s"), e=Sum("cpu_s"), f=Max("mem_max")
        )
        .values_list("p", "a", "b", "c", "d", "e", "f")
    )
    if until > mark:
        known = Q(gpu_memory__isnull=False)
        sources.append(
            SessionSample.objects.filter(session=session, t__gte=max(since, mark), t__lt=until)
            .annotate(p=F("t") - F("t") % width)
            .values("p")
            .order_by("p")
            .annotate(
                a=Sum("span"),
                b=Sum("span", filter=known),
                c=Sum(F("gpu_memory") * F("span"), filter=known),
                d=Sum(F("gpu_util") * F("span"), filter=Q(gpu_util__isnull=False)),
                e=Sum(F("cpu") * F("span"), filter=Q(cpu__isnull=False)),
                f=Max("mem"),
            )
            .values_list("p", "a", "b", "c", "d", "e", "f")
        )
    merged: dict[int, list] = {}
    for source in sources:
        for start, *values in source:
            values = [v or 0 for v in values[:5]] + [values[5]]
            if start in merged:
                old = merged[start]
                merged[start] = [a + b for a, b in zip(old[:5], values[:5])] + [
                    max(filter(None.__ne__, (old[5], values[5])), default=None)
                ]
            else:
                merged[start] = values
    return [(start, *merged[start]) for start in sorted(merged)]


def _columns(rows, names: tuple[str, ...], spans: list[int]) -> dict:
    """Rows `(t, *values)` (t ascending, epoch seconds) as columns named `names`, with a None
    point before any row that comes more than twice its span (seconds it stands for) after the
    one before: a chart breaks its line there (uPlot draws null as a gap) instead of drawing a zero."""
    columns: dict[str, list] = {name: [] for name in names}
    previous = None
    for row, span in zip(rows, spans):
        if previous is not None and row[0] - previous > 2 * max(span, 1) + 1:
            for name in names:
                columns[name].append(previous + 1 if name == "t" else None)  # the gap, drawn as a break
        for name, value in zip(names, row):
            columns[name].append(value)
        previous = row[0]
    return columns


def node_device_series(*, node, since: int, until: int) -> list[dict]:
    """Each device of `node` (MIG instances left out: their parent GPU is charted) with its
    memory used and utilisation over [since, until) (epoch seconds), in at most three queries
    whatever the number of devices: `[{"index", "uuid", "model_name", "memory_size": bytes,
    "t": [epoch s], "memory_used": [bytes|None], "util": [percent|None]}]` by index. Full
    resolution while the range starts after the watermark; else 5-minute means (hourly for a
    range longer than SERIES_MAX_POINTS buckets), the newest of them averaged from the samples
    past the watermark. A device's samples are `interval` apart (its smallest step); a longer
    silence is a None point, as in `session_series`."""
    from django.db.models import Avg

    devices = list(
        Device.objects.filter(node=node, is_mig_device=False)
        .order_by("index")
        .values("id", "index", "device_id", "model_name", "memory_size")
    )
    ids = [d["id"] for d in devices]
    mark = _watermark()
    by_device: collections.defaultdict[Any, list] = collections.defaultdict(list)
    rows: Iterable[tuple]
    if since >= mark:
        rows = (
            DeviceSample.objects.filter(device_id__in=ids, t__gte=since, t__lt=until)
            .order_by("t")
            .values_list("device_id", "t", "memory_used", "util")
        )
        width = None
    else:
        width = SessionPeriodRollup.HOUR if until - since > SERIES_MAX_POINTS * 300 else 300
        period = F("bucket") - F("bucket") % width
        found = list(
            DeviceRollup.objects.filter(device_id__in=ids, bucket__gte=since - since % width, bucket__lt=min(until, mark))
            .annotate(p=period)
            .values("device_id", "p")
            .order_by("p")
            .annotate(m=Avg("memory_used_avg"), u=Avg("util_avg"))
            .values_list("device_id", "p", "m", "u")
        )
        if until > mark:  # the buckets not closed yet, from their samples
            found += list(
                DeviceSample.objects.filter(device_id__in=ids, t__gte=mark, t__lt=until)
                .annotate(p=F("t") - F("t") % width)
                .values("device_id", "p")
                .order_by("p")
                .annotate(m=Avg("memory_used"), u=Avg("util"))
                .values_list("device_id", "p", "m", "u")
            )
        rows = [(d, p, None if m is None else int(m), None if u is None else int(round(u))) for d, p, m, u in found]
    for device_id, *row in rows:
        points = by_device[device_id]
        if points and width and points[-1][0] == row[0]:  # an hour both closed buckets and samples fall in
            continue
        points.append(tuple(row))
    out = []
    for d in devices:
        points = by_device[d["id"]][-SERIES_MAX_POINTS:]
        steps = [b[0] - a[0] for a, b in zip(points, points[1:]) if b[0] > a[0]]
        span = width or min(steps, default=1)
        out.append(
            {
                "index": d["index"],
                "uuid": d["device_id"],
                "model_name": d["model_name"],
                "memory_size": d["memory_size"],
                **_columns(points, ("t", "memory_used", "util"), [span] * len(points)),
            }
        )
    return out


def latest_session_usage(*, user, session_ids: list, horizon: int) -> list[dict]:
    """The newest sample since `horizon` (epoch seconds) of each of `session_ids` that `user`
    may see (own, or any for staff), for the list's gauges, in two queries whatever the number:
    `[{"id", "t": epoch s | None, "gpu_memory": bytes | None, "gpu_util": percent | None,
    "gpu_memory_limit": bytes granted (held allocations)}]`. A session with no sample since
    `horizon` has t None (its agent is silent: unknown, not zero)."""
    visible = ComputeSession.objects.filter(pk__in=session_ids)
    if not user.is_staff:
        visible = visible.filter(owner=user)
    limits = dict(
        visible.annotate(limit=Sum("allocations__memory", filter=Q(allocations__released_at__isnull=True))).values_list(
            "id", "limit"
        )
    )
    newest = {}
    for sid, t, gpu_memory, gpu_util in (
        SessionSample.objects.filter(session_id__in=list(limits), t__gte=horizon)
        .order_by("t")
        .values_list("session_id", "t", "gpu_memory", "gpu_util")
    ):
        newest[sid] = (t, gpu_memory, gpu_util)
    return [
        {
            "id": sid,
            "t": newest.get(sid, (None,))[0],
            "gpu_memory": newest.get(sid, (None, None))[1],
            "gpu_util": newest.get(sid, (None, None, None))[2],
            "gpu_memory_limit": limit or 0,
        }
        for sid, limit in limits.items()
    ]


# --- what /metrics exports ------------------------------------------------------------------------


def latest_device_samples(*, horizon: int) -> list[dict]:
    """The newest sample of each device sampled since `horizon` (epoch seconds), with its node,
    index, UUID and model: `[{"node", "index", "uuid", "model", "memory_used", "memory_total", "util"}]`."""
    newest = {}
    for r in (
        DeviceSample.objects.filter(t__gte=horizon)
        .order_by("t")
        .values(
            "device_id",
            "device__node__name",
            "device__index",
            "device__device_id",
            "device__model_name",
            "memory_used",
            "memory_total",
            "util",
        )
    ):
        newest[r["device_id"]] = {
            "node": r["device__node__name"],
            "index": r["device__index"],
            "uuid": r["device__device_id"],
            "model": r["device__model_name"],
            "memory_used": r["memory_used"],
            "memory_total": r["memory_total"],
            "util": r["util"],
        }
    return list(newest.values())


def latest_session_samples(*, horizon: int) -> dict:
    """{session id: (gpu_memory bytes, gpu_util percent, cpu milli-cores, mem bytes)} of each
    session's newest sample since `horizon` (a few per session: the last minute or so)."""
    rows = (
        SessionSample.objects.filter(t__gte=horizon)
        .order_by("t")
        .values_list("session_id", "gpu_memory", "gpu_util", "cpu", "mem")
    )
    return {r[0]: r[1:] for r in rows}


def folder_use_list(*, user) -> list[dict]:
    """The data folders `user` sees in their sessions, as each node's agent last measured them
    (usage.FolderUse): their own `~/data` and each of their projects' `~/projects/<name>`, one row per
    node that measured it: `[{"folder": "~/data" | "~/projects/<name>", "node": node name, "used":
    bytes, "limit": bytes, "t": epoch seconds}]`, by folder then node. One query."""
    rows = (
        FolderUse.objects.filter(Q(owner=user) | Q(project__members=user))
        .values("node__name", "project__name", "used", "limit", "t")
        .order_by(F("project__name").asc(nulls_first=True), "node__name")
        .distinct()
    )
    return [
        {
            "folder": "~/data" if r["project__name"] is None else f"~/projects/{r['project__name']}",
            "node": r["node__name"],
            "used": r["used"],
            "limit": r["limit"],
            "t": r["t"],
        }
        for r in rows
    ]


class SessionsUsageReads(UsageReads):
    """What sessions reads of usage (sessions.usage_reads: usage sits above it), from this app's
    tables; set by UsageConfig.ready(). One query each."""

    def lifetime_bounds(self) -> dict[int | None, LifetimeBounds]:
        return {
            p.resource_group_id: LifetimeBounds(idle_timeout=p.idle_timeout, max_lifetime=p.max_lifetime, grace=p.grace)
            for p in IdlePolicy.objects.all()
        }

    def max_lifetimes(self) -> dict[str, int]:
        rows = IdlePolicy.objects.filter(max_lifetime__isnull=False).values_list("resource_group__name", "max_lifetime")
        return {name or "": seconds for name, seconds in rows if seconds}

    def idle_watches(self, *, session_ids: Iterable[UUID]) -> dict[UUID, IdleWatch]:
        return {
            a.session_id: IdleWatch(last_input=a.last_input, deadline=a.deadline, reason=a.reason)
            for a in SessionActivity.objects.filter(session__in=list(session_ids))
        }

    def folder_use(self, *, user: Any) -> list[dict[str, Any]]:
        return folder_use_list(user=user)


class FleetDeviceSamples(DeviceSamples):
    """What the fleet overview reads of the device samples (accelerators.fleet.DeviceSamples:
    usage sits above accelerators), from usage.DeviceSample; set by UsageConfig.ready(). One
    query each."""

    def newest(self, *, device_ids: list[Any], since: int) -> dict[Any, dict[str, Any]]:
        newest: dict[Any, dict[str, Any]] = {}
        rows = DeviceSample.objects.filter(device_id__in=device_ids, t__gte=since).order_by("t")
        for device_id, t, memory_used, util in rows.values_list("device_id", "t", "memory_used", "util"):
            newest[device_id] = {"memory_used": memory_used, "util": util, "t": t}
        return newest

    def used(self, *, since: int, node_ids: list[Any] | None) -> tuple[int, int, Any]:
        rows = DeviceSample.objects.filter(t__gte=since, device__is_mig_device=False)
        if node_ids is not None:
            rows = rows.filter(device__node_id__in=node_ids)
        per_gpu = rows.values("device_id").annotate(m=Avg("memory_used"), u=Avg("util"))
        found = per_gpu.aggregate(gpus=Count("device_id"), memory=Sum("m"), util=Avg("u"))  # over a subquery of the means
        return found["gpus"] or 0, int(found["memory"] or 0), found["util"]
