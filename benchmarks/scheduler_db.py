"""The database-backed scheduler placing 1,000 pending sessions on openb's 1,213-node inventory.

    DATABASE_URL=postgres://… REDIS_URL=redis://… python benchmarks/scheduler_db.py [--sessions 1000]
        [--policy binpack] [--json]

Creates a throw-away database (Django's test-database machinery: `bench_scheduler_<name>`, migrated,
dropped afterwards), writes the 1,213 GPU nodes of openb_node_list_gpu_node.csv with their
devices (1.0 fGPU per GPU, fractional mode, quantum 0.01) and the sessions, PENDING, as
`session_create` writes them (validated by `request_validate`; fGPU requests from openb pods: the
sharing fraction, or the GPU count), then
times one `schedule_pending(limit=N)` pass, the real one: locks, allocator, Allocation rows,
status changes, and after commit the notices to the pages (`sessions.lifecycle.events`, through the Redis
channel layer) and the agents' start messages (Celery, to the broker; purged afterwards, as no
agent runs; `--no-starts` skips them). Reports the time to commit, the after-commit time, and
their sum (end to end). Afterwards it checks that no device or node is over-committed.
Target: < 10 s end to end.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

GiB = 1 << 30


def build(sessions: int, policy: str):
    from django.contrib.auth import get_user_model

    from accelerators.models import Device, FractionalSettings, Node, ResourceGroup
    from benchmarks.openb import TRACE_DIR, inflate, load_nodes, load_pods
    from accelerators.allocation.requests import request_to_spec
    from sessions.models import ComputeSession
    from sessions.scheduling.placement import request_validate

    FractionalSettings.objects.update_or_create(
        slot_name="cuda",
        defaults={"allocation_mode": "fractional", "unit_mem": 16 * GiB, "unit_proc": 108, "quantum_size": Decimal("0.01")},
    )
    ResourceGroup.objects.update_or_create(name="default", defaults={"policy": policy})
    rows = list(csv.DictReader(open(TRACE_DIR / "openb_node_list_gpu_node.csv")))
    nodes = Node.objects.bulk_create(
        [Node(name=r["sn"], cpu_count=int(r["cpu_milli"]) // 1000, memory_size=int(r["memory_mib"]) << 20) for r in rows]
    )
    devices = []
    for node, r in zip(nodes, rows):
        for i in range(int(r["gpu"])):
            uuid = f"GPU-{node.name[-4:]}-{i:04d}"
            devices.append(
                Device(
                    node=node,
                    slot_name="cuda",
                    device_id=uuid,
                    index=i,
                    mother_uuid=uuid,
                    model_name=r["model"],
                    numa_node=i // 4,
                    subproc_count=108,
                    memory_size=16 * GiB,
                )
            )
    Device.objects.bulk_create(devices)
    user = get_user_model().objects.create_user("bench")
    index = load_nodes()
    pods = [p for p in inflate(load_pods("default"), 42, int(index.cap.sum())) if p.gpu_amount][:sessions]
    rows = []
    for i, pod in enumerate(pods):  # session_create's row, without its per-session never-fits check
        amount = Decimal(pod.amount) / 1000 if pod.count == 1 and pod.amount < 1000 else Decimal(pod.count)
        resources = {"cuda.shares": str(amount), "cpu": max(1, -(-pod.cpu // 1000)), "mem": f"{max(pod.mem, 1)}M"}
        request, _ = request_validate(resources=resources)
        rows.append(
            ComputeSession(
                owner=user,
                name=f"s{i}",
                resources=resources,
                request_spec=request_to_spec(request),
                slot_name=request.slot,
                slot_subtype=request.kind,
                amount=request.amount,
                cpu=request.cpu,
                mem=request.mem,
                status_reason="waiting for the scheduler",
            )
        )
    ComputeSession.objects.bulk_create(rows)
    return len(pods)


def _time_after_commit() -> dict[str, float]:
    """Time the after-commit callbacks apart from the pass: {callback name: seconds}."""
    from django.db import transaction

    spent: dict[str, float] = {}
    real = transaction.on_commit

    def on_commit(func, *args, **kwargs):
        name = getattr(getattr(func, "func", func), "__qualname__", "?").split(".<locals>")[0]

        def timed():
            began = time.perf_counter()
            try:
                func()
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - began

        return real(timed, *args, **kwargs)

    transaction.on_commit = on_commit
    return spent


def purge_agent_queues(node_names: list[str]) -> int:
    """Drop the start messages no agent will take (queues `agent.<node>`); returns how many."""
    from common.celery import agent_queue, app

    dropped = 0
    with app.connection_for_write() as conn:
        for name in node_names:
            dropped += conn.default_channel.queue_purge(agent_queue(name)) or 0
            conn.default_channel.queue_delete(agent_queue(name))
    return dropped


def check_no_over_commit() -> list[str]:
    from django.db.models import Q, Sum

    from accelerators.models import Device, Node
    from sessions.models import ACTIVE_STATUSES

    problems = []
    live = Q(allocations__released_at__isnull=True)
    for d in Device.objects.annotate(
        mem=Sum("allocations__memory", filter=live, default=0), procs=Sum("allocations__procs", filter=live, default=Decimal(0))
    ):
        if d.mem > d.memory_size or d.procs > d.subproc_count:
            problems.append(f"device {d.device_id}: {d.mem} bytes, {d.procs} SMs")
    active = Q(sessions__status__in=ACTIVE_STATUSES)
    for n in Node.objects.annotate(
        cpu=Sum("sessions__cpu", filter=active, default=0), mem=Sum("sessions__mem", filter=active, default=0)
    ):
        if n.cpu > n.cpu_count or n.mem > n.memory_size:
            problems.append(f"node {n.name}: {n.cpu} cores, {n.mem} bytes")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--policy", default="binpack")
    parser.add_argument(
        "--no-starts",
        action="store_true",
        help="do not send the agents' start messages to the broker (by default they are sent, "
        "then purged, as no agent runs here)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import django

    django.setup()
    from accelerators.models import Node
    from benchmarks.database import throwaway_database
    from sessions.scheduling import scheduler
    from sessions.models import ComputeSession, SessionStatus

    with throwaway_database("bench_scheduler"):
        created = build(args.sessions, args.policy)
        if args.no_starts:
            scheduler._send_starts = lambda starts: None
        after_commit = _time_after_commit()
        began = time.perf_counter()
        scheduled = scheduler.schedule_pending(limit=args.sessions)
        seconds = time.perf_counter() - began
        after = sum(after_commit.values())
        problems = check_no_over_commit()
        purged = 0 if args.no_starts else purge_agent_queues(list(Node.objects.values_list("name", flat=True)))
        result = {
            "policy": args.policy,
            "sessions": created,
            "scheduled": len(scheduled),
            "pending": ComputeSession.objects.filter(status=SessionStatus.PENDING).count(),
            "seconds": round(seconds, 2),
            "seconds_to_commit": round(seconds - after, 2),
            "seconds_after_commit": round(after, 2),
            "seconds_after_commit_notices": round(after_commit.get("sessions_notify", 0.0), 2),
            "seconds_after_commit_starts": round(after_commit.get("_send_starts", 0.0), 2),
            "start_messages_sent": purged,
            "over_committed": problems[:5],
        }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['scheduled']} of {created} pending sessions scheduled in one pass on 1,213 nodes "
            f"({args.policy}): {seconds:.2f} s end to end = {result['seconds_to_commit']:.2f} s to commit (locks, "
            f"allocator, rows) + {result['seconds_after_commit']:.2f} s after commit "
            f"({result['seconds_after_commit_notices']:.2f} s of notices to the pages, "
            f"{result['seconds_after_commit_starts']:.2f} s of {result['start_messages_sent']} start messages to "
            f"the agents' queues); over-committed devices/nodes: {len(problems)}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
