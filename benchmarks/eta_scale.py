"""ETA, what-if and the fragmentation map at scale (issue 35.2: each ≤ 1 s at 1,000 nodes × 8 GPUs
with 1,000 sessions waiting), first ask and asked again, beside `GET /api/v1/me/` in the same run.

    DATABASE_URL=postgres://…/NAME REDIS_URL=redis://… python benchmarks/eta_scale.py seed [--nodes 1000]
        [--running 1000] [--waiting 1000]
    DATABASE_URL=… REDIS_URL=… python benchmarks/eta_scale.py measure [--rounds 3] [--profile FILE]

`seed` migrates the database DATABASE_URL names (it is kept: the seed takes minutes at 1,000 nodes)
and writes what benchmarks/scale.py's phases do: the cluster (tests/seed.py `gpu_cluster`,
`--nodes` × 8 mock GPUs of 2 fGPU), one staff user, `--running` sessions of 0.5 fGPU placed by one
scheduler pass (SCHEDULED: they hold their room), and `--waiting` more left PENDING (no pass).

`measure` warms what a web process keeps (the cluster view, the kept sessions where the tree has
them, one ETA, what-if and map asked before the rounds), then runs, in this process through
Django's test client (the web's own cost, no network), `--rounds` rounds of: /me/; a change (one
running session ends: its allocations released through `session_report_apply`, as an agent's
report does — the queue and the cluster both change); then
the first ETA of the queue's head after it ("eta first"), the head again ("eta again"), the tail,
the what-if (draining gpu-node-0) twice and the fragmentation map twice. Medians in ms of the wall
time and of this process's CPU time (steadier than the wall time on a loaded machine; the
database's own CPU is not in it), the load average (1 min) before and after; `--profile` writes
cProfile's stats of the rounds. The database is left as the rounds leave it (a session fewer
running each round). Point PYTHONPATH at another tree to measure it on the same database (an A/B:
run both in turn).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from benchmarks.scale import FRAGMENTATION, ME, REQUEST, SESSIONS, WHAT_IF, _check, _load  # noqa: E402 (after the path)

USER = "bench-eta-scale"


def _timed(call: Callable[[], object], cpu: list[float] | None = None) -> float:
    """`call()`'s wall seconds; its CPU seconds in this process appended to `cpu`."""
    began, began_cpu = time.perf_counter(), time.process_time()
    call()
    if cpu is not None:
        cpu.append(time.process_time() - began_cpu)
    return time.perf_counter() - began


def seed(args) -> None:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import transaction

    from sessions.admission.launch import session_create
    from sessions.scheduling.scheduler import schedule_pending
    from tests.seed import gpu_cluster

    call_command("migrate", verbosity=0)
    began = time.perf_counter()
    with transaction.atomic():
        gpu_cluster(nodes=args.nodes, gpus=8)
    user = get_user_model().objects.create_user(USER, is_staff=True)
    with transaction.atomic():
        for i in range(args.running):
            session_create(owner=user, name=f"run-{i}", resources=REQUEST)
    schedule_pending()
    with transaction.atomic():
        for i in range(args.waiting):
            session_create(owner=user, name=f"wait-{i}", resources=REQUEST)
    print(f"seeded in {time.perf_counter() - began:.0f} s (load {_load()})", file=sys.stderr)


def _end_one() -> None:
    """One running session ends as its agent reports it (allocations released)."""
    from sessions.lifecycle.services import session_report_apply
    from sessions.models import ComputeSession

    session = ComputeSession.objects.filter(status__in=("SCHEDULED", "PREPARING", "RUNNING")).order_by("created_at").first()
    assert session is not None, "no running session left to end"
    session_report_apply(session_id=session.pk, status="TERMINATED", exit_code=0, reason="")


def measure(args) -> None:
    from django.contrib.auth import get_user_model
    from django.test.utils import setup_test_environment
    from rest_framework.test import APIClient

    from accounts.services import login_token_issue
    from sessions.models import ComputeSession

    setup_test_environment()  # the test client's host, testserver, allowed
    user = get_user_model().objects.get(username=USER)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {login_token_issue(user=user)}")
    queue = list(ComputeSession.objects.filter(status="PENDING").order_by("created_at").values_list("pk", flat=True))
    head, tail = f"{SESSIONS}{queue[0]}/eta/", f"{SESSIONS}{queue[-1]}/eta/"
    names = ["me", "eta_first", "eta_again", "eta_tail", "what_if_first", "what_if_again", "frag_first", "frag_again"]
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    profile = cProfile.Profile() if args.profile else None
    from accelerators.cluster_view import cluster_view

    cluster_view().snapshot()  # a web process's view is warm: its first full read (seconds) is not measured
    try:  # and so are its kept sessions (sessions.scheduling.kept_sessions: read whole once, then what changed)
        from sessions.scheduling.kept_sessions import kept_sessions

        kept_sessions().read()
    except ImportError:  # a tree from before them (an A/B's base)
        pass
    # one ask of each before the rounds, as a web process that has answered them before: its first
    # scope read, cluster index and workload are not the first ask after a change
    _check(api.get(head)), _check(api.post(WHAT_IF, {"drain": ["gpu-node-0"]}, format="json")), _check(api.get(FRAGMENTATION))
    load_before = _load()
    _check(api.get(ME))
    for _ in range(args.rounds):
        times["me"].append(_timed(lambda: _check(api.get(ME)), cpu["me"]))
        _end_one()
        if profile:
            profile.enable()
        times["eta_first"].append(_timed(lambda: _check(api.get(head)), cpu["eta_first"]))
        times["eta_again"].append(_timed(lambda: _check(api.get(head)), cpu["eta_again"]))
        times["eta_tail"].append(_timed(lambda: _check(api.get(tail)), cpu["eta_tail"]))
        for k in ("what_if_first", "what_if_again"):
            times[k].append(_timed(lambda: _check(api.post(WHAT_IF, {"drain": ["gpu-node-0"]}, format="json")), cpu[k]))
        for k in ("frag_first", "frag_again"):
            times[k].append(_timed(lambda: _check(api.get(FRAGMENTATION)), cpu[k]))
        if profile:
            profile.disable()
        print({k: round(1000 * v[-1]) for k, v in times.items()}, f"load {_load()}", file=sys.stderr, flush=True)
    if profile:
        profile.dump_stats(args.profile)
    medians = {k: 1000 * statistics.median(v) for k, v in times.items()}
    cpu_medians = {k: 1000 * statistics.median(v) for k, v in cpu.items()}
    pending = ComputeSession.objects.filter(status="PENDING").count()
    running = ComputeSession.objects.filter(status__in=("SCHEDULED", "PREPARING", "RUNNING")).count()
    print(
        f"{os.environ.get('TREE', '?'):<6} load {load_before}→{_load()} waiting {pending} running {running} "
        + " ".join(f"{k} {v:.0f}" for k, v in medians.items())
        + " (ms, medians of "
        + str(args.rounds)
        + "); CPU of this process: "
        + " ".join(f"{k} {v:.0f}" for k, v in cpu_medians.items())
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["seed", "measure"])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--running", type=int, default=1000)
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("FGPU_LOG_LEVEL", "WARNING")
    os.environ.setdefault("FGPU_SECRET_KEY", secrets.token_urlsafe(48))
    import django

    django.setup()
    from django.db import connection

    if connection.vendor != "postgresql":
        sys.exit("benchmarks/eta_scale.py needs PostgreSQL: set DATABASE_URL=postgres://…")
    seed(args) if args.what == "seed" else measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
