"""A month of usage samples for 1,000 sessions in PostgreSQL, and how fast the usage API reads it.

    DATABASE_URL=postgres://… python benchmarks/usage_query.py [--sessions 1000] [--days 30]
        [--interval 5] [--repeat 5] [--json]

Creates a throw-away database (`bench_usage_<name>`, migrated, dropped afterwards) and fills it in
the usage app's own shapes (usage/models.py, usage.services.usage_rollup): every session runs the
whole range on one GPU (4 sessions per 8 GiB GPU, 8 GPUs per node), 50 users in 10 projects
(each user in one or two), with

- full-resolution samples (`usage_sessionsample`, `usage_devicesample`) every `--interval`
  seconds for the last 24 h (FGPU_USAGE_RAW_RETENTION), as the agents send them;
- 5-minute rollups (`usage_sessionrollup`, `usage_devicerollup`) from the range's start up to the
  watermark (now − FGPU_USAGE_LATENESS, a bucket boundary), as `usage_rollup` leaves them;

written by INSERT … SELECT generate_series (synthetic values: memory and utilisation that move
with time, no two sessions alike); then the hourly and daily sums (`usage_sessionperiodrollup`)
are made by `usage.services.usage_rollup` itself, run until it has caught up (its time is
reported: what the periodic task spends the first time after an upgrade). Then, each `--repeat`
times (median and max reported), it times through the API views (DRF request → selector → serializer, as an administrator):

- `GET /api/v1/usage/?from=<range start>&to=<now>&group_by=user|project|node` (the month);
- one session's chart, `GET /api/v1/sessions/<id>/usage/`: the last hour (raw samples) and the
  whole range (5-minute means);

and prints the rows and the size on disk of each usage table (`pg_total_relation_size`: table,
indexes and TOAST) and of the database. Target (issue 15): each query under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from datetime import timezone as dt_timezone
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

GiB = 1 << 30
BUCKET = 300
USAGE_TABLES = (
    "usage_sessionsample",
    "usage_sessionrollup",
    "usage_sessionperiodrollup",
    "usage_devicesample",
    "usage_devicerollup",
)


def build(*, sessions: int, days: int, interval: int, now: int) -> dict:
    """The cluster, users, projects, sessions and allocations through the ORM, then the samples and
    rollups in SQL, then the hourly and daily sums by usage_rollup. Returns {"start", "watermark",
    "rows": {table: count}, "seconds": to build, "period_seconds": usage_rollup's runs, "period_runs"}."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection

    from accelerators.allocation.requests import request_to_spec
    from accelerators.models import Device, FractionalSettings, Node
    from sessions.models import Allocation, ComputeSession, Project, SessionStatus
    from sessions.lifecycle.services import request_validate
    from usage.models import RollupState
    from usage.services import usage_rollup

    began = time.perf_counter()
    FractionalSettings.objects.update_or_create(
        slot_name="cuda",
        defaults={"allocation_mode": "fractional", "unit_mem": 4 * GiB, "unit_proc": 40, "quantum_size": Decimal("0.25")},
    )
    gpus = -(-sessions // 4)
    nodes = Node.objects.bulk_create(
        [Node(name=f"node-{i:04d}", cpu_count=64, memory_size=512 * GiB) for i in range(-(-gpus // 8))]
    )
    devices = Device.objects.bulk_create(
        [
            Device(
                node=nodes[i // 8],
                slot_name="cuda",
                device_id=f"GPU-{i:06d}",
                index=i % 8,
                mother_uuid=f"GPU-{i:06d}",
                model_name="A10-8GB",
                numa_node=0,
                subproc_count=80,
                memory_size=8 * GiB,
            )
            for i in range(gpus)
        ]
    )
    users = [get_user_model().objects.create_user(f"user{i:02d}") for i in range(50)]
    projects = [Project.objects.create(name=f"project{i}") for i in range(10)]
    for i, user in enumerate(users):
        projects[i % 10].members.add(user)
        if i % 3 == 0:
            projects[(i + 1) % 10].members.add(user)
    start = (now - days * 86400) // BUCKET * BUCKET
    started = datetime.fromtimestamp(start, dt_timezone.utc)
    resources = {"cuda.shares": "0.5"}
    request, _ = request_validate(resources=resources)
    rows = ComputeSession.objects.bulk_create(
        [
            ComputeSession(
                owner=users[i % 50],
                name=f"s{i}",
                resources=resources,
                request_spec=request_to_spec(request),
                slot_name=request.slot,
                slot_subtype=request.kind,
                amount=request.amount,
                cpu=request.cpu,
                mem=request.mem,
                status=SessionStatus.RUNNING,
                node=devices[i // 4].node,
                scheduled_at=started,
                started_at=started,
            )
            for i in range(sessions)
        ]
    )
    ComputeSession.objects.update(created_at=started)
    Allocation.objects.bulk_create(
        [
            Allocation(session=s, device=devices[i // 4], shares=Decimal("0.5"), memory=2 * GiB, procs=Decimal(20))
            for i, s in enumerate(rows)
        ]
    )
    Allocation.objects.update(created_at=started)
    watermark = (now - settings.FGPU_USAGE_LATENESS) // BUCKET * BUCKET
    RollupState.objects.update_or_create(pk=1, defaults={"watermark": watermark})
    raw_from = (now - settings.FGPU_USAGE_RAW_RETENTION) // interval * interval
    with connection.cursor() as cur:
        cur.execute(
            "CREATE TEMP TABLE bench_s AS SELECT id, row_number() OVER (ORDER BY name) AS n FROM compute_sessions_computesession"
        )
        cur.execute(
            "CREATE TEMP TABLE bench_d AS SELECT id, row_number() OVER (ORDER BY device_id) AS n FROM accelerators_device"
        )
        # Session samples: memory up to the 2 GiB granted, utilisation 0-99 %, CPU 0-3.99 cores.
        cur.execute(
            f"""
            INSERT INTO usage_sessionsample (session_id, t, span, gpu_memory, gpu_util, cpu, mem)
            SELECT s.id, t, {interval}, (({2 * GiB}::bigint * ((t / 60 + s.n * 13) %% 100)) / 100),
                   ((t / {interval} + s.n * 7) %% 100), ((t / {interval} * 37 + s.n * 101) %% 4000), {GiB}
            FROM bench_s s CROSS JOIN generate_series(%s::bigint, %s::bigint, {interval}) AS t""",
            [raw_from, now - 1],
        )
        cur.execute(
            f"""
            INSERT INTO usage_sessionrollup (session_id, bucket, samples, span_s, gpu_memory_s, gpu_memory_max, gpu_util_s,
                                             gpu_util_max, gpu_span_s, cpu_s, mem_max)
            SELECT s.id, b, {BUCKET // interval}, {BUCKET}, (({2 * GiB}::bigint * ((b / 60 + s.n * 13) %% 100)) / 100) * {BUCKET},
                   (({2 * GiB}::bigint * ((b / 60 + s.n * 13) %% 100 + 5)) / 100), ((b / {BUCKET} + s.n * 7) %% 100) * {BUCKET},
                   ((b / {BUCKET} + s.n * 7) %% 100), {BUCKET}, ((b / {BUCKET} * 37 + s.n * 101) %% 4000) * {BUCKET}, {GiB}
            FROM bench_s s CROSS JOIN generate_series(%s::bigint, %s::bigint, {BUCKET}) AS b""",
            [start, watermark - BUCKET],
        )
        cur.execute(
            f"""
            INSERT INTO usage_devicesample (device_id, t, memory_used, memory_total, util)
            SELECT d.id, t, (({8 * GiB}::bigint * ((t / 60 + d.n * 11) %% 100)) / 100), {8 * GiB}, ((t / {interval} + d.n) %% 100)
            FROM bench_d d CROSS JOIN generate_series(%s::bigint, %s::bigint, {interval}) AS t""",
            [raw_from, now - 1],
        )
        cur.execute(
            f"""
            INSERT INTO usage_devicerollup (device_id, bucket, samples, memory_used_avg, memory_used_max, memory_total, util_avg)
            SELECT d.id, b, {BUCKET // interval}, (({8 * GiB}::bigint * ((b / 60 + d.n * 11) %% 100)) / 100),
                   (({8 * GiB}::bigint * ((b / 60 + d.n * 11) %% 100 + 5)) / 100), {8 * GiB}, ((b / {BUCKET} + d.n) %% 100)
            FROM bench_d d CROSS JOIN generate_series(%s::bigint, %s::bigint, {BUCKET}) AS b""",
            [start, watermark - BUCKET],
        )
        cur.execute("ANALYZE")
    rolled, runs = time.perf_counter(), 0
    while True:  # as beat's fgpu.manager.usage_rollup catches up after an upgrade
        runs += 1
        done = usage_rollup(now=now)
        if not done["hours"] and not done["days"]:
            break
    period_seconds = time.perf_counter() - rolled
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
        counts = {}
        for table in USAGE_TABLES:
            cur.execute(f"SELECT count(*) FROM {table}")
            counts[table] = cur.fetchone()[0]
    return {
        "start": start,
        "watermark": watermark,
        "rows": counts,
        "seconds": time.perf_counter() - began,
        "period_seconds": period_seconds,
        "period_runs": runs,
    }


def sizes() -> dict:
    """Bytes on disk: each usage table with its indexes and TOAST, and the whole database."""
    from django.db import connection

    with connection.cursor() as cur:
        out = {}
        for table in USAGE_TABLES:
            cur.execute("SELECT pg_total_relation_size(%s)", [table])
            out[table] = cur.fetchone()[0]
        cur.execute("SELECT pg_database_size(current_database())")
        out["database"] = cur.fetchone()[0]
    return out


def timed(view, path: str, params: dict, user, repeat: int, **kwargs) -> dict:
    """GET `path` through `view` `repeat` times: {"median_ms", "max_ms", "answer": the last body}."""
    from rest_framework.test import APIRequestFactory, force_authenticate

    factory, spent, body = APIRequestFactory(), [], None
    for _ in range(repeat):
        request = factory.get(path, params)
        force_authenticate(request, user=user)
        began = time.perf_counter()
        response = view(request, **kwargs)
        response.render()
        spent.append((time.perf_counter() - began) * 1000)
        assert response.status_code == 200, response.content[:300]
        body = json.loads(response.content)
    return {"median_ms": round(statistics.median(spent), 1), "max_ms": round(max(spent), 1), "answer": body}


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5, help="seconds between an agent's samples")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from benchmarks.database import throwaway_database
    from sessions.models import ComputeSession
    from usage.api import session_usage_view, usage_view

    now = int(time.time())
    with throwaway_database("bench_usage"):
        built = build(sessions=args.sessions, days=args.days, interval=args.interval, now=now)
        admin = get_user_model().objects.create_user("bench-admin", is_staff=True)
        frm = datetime.fromtimestamp(built["start"], dt_timezone.utc).isoformat()
        to = datetime.fromtimestamp(now, dt_timezone.utc).isoformat()
        report = {}
        for group_by in ("user", "project", "node"):
            r = timed(usage_view, "/api/v1/usage/", {"from": frm, "to": to, "group_by": group_by}, admin, args.repeat)
            report[group_by] = {"median_ms": r["median_ms"], "max_ms": r["max_ms"], "rows": len(r["answer"]["rows"])}
        session = ComputeSession.objects.order_by("name").first()
        chart = {}
        for label, since in (("last hour", now - 3600), ("whole range", built["start"])):
            r = timed(
                session_usage_view,
                f"/api/v1/sessions/{session.pk}/usage/",
                {"since": since},
                admin,
                args.repeat,
                session_id=session.pk,
            )
            chart[label] = {
                "median_ms": r["median_ms"],
                "max_ms": r["max_ms"],
                "points": len(r["answer"]["t"]),
                "resolution": r["answer"]["resolution"],
            }
        disk = sizes()
    result = {
        "sessions": args.sessions,
        "days": args.days,
        "interval_s": args.interval,
        "repeat": args.repeat,
        "build_seconds": round(built["seconds"], 1),
        "period_rollup_seconds": round(built["period_seconds"], 1),
        "period_rollup_runs": built["period_runs"],
        "rows": built["rows"],
        "bytes": disk,
        "usage_api": report,
        "session_chart": chart,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    usage_bytes = sum(disk[t] for t in USAGE_TABLES)
    print(
        f"{args.sessions} sessions × {args.days} days, samples every {args.interval} s "
        f"(built in {result['build_seconds']} s); times are the median and max of {args.repeat}"
    )
    print(
        f"  usage_rollup made the hourly and daily sums in {result['period_rollup_seconds']} s "
        f"({result['period_rollup_runs']} runs, the last with nothing left to do)"
    )
    for table in USAGE_TABLES:
        print(f"  {table:25} {built['rows'][table]:>12,} rows  {human(disk[table]):>10}")
    print(f"  usage tables together     {human(usage_bytes):>28}; whole database {human(disk['database'])}")
    for group_by, r in report.items():
        print(
            f"GET /api/v1/usage/ month, group_by={group_by:8} {r['median_ms']:>8.1f} ms (max {r['max_ms']:.1f}), {r['rows']} rows"
        )
    for label, r in chart.items():
        print(
            f"GET /api/v1/sessions/<id>/usage/ {label:12} {r['median_ms']:>8.1f} ms (max {r['max_ms']:.1f}), "
            f"{r['points']} points ({r['resolution']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
