"""How long the scheduler's fair-share read takes as allocations pile up (issue 17.1).

    DATABASE_URL=postgres://… python benchmarks/fairshare.py [--allocations 10000 100000] [--owners 200]
        [--repeat 5]

Creates a throw-away database (`bench_fairshare_<name>`, migrated, dropped afterwards) with one
node of 8 mock GPUs, `--owners` users (half of them in 10 projects) and, for each size in
`--allocations`, that many ended allocations spread evenly over the last 140 days (20 half-lives
of 7 days: all inside the horizon) plus one running allocation per owner. Times, median and max
of `--repeat`:

- `sessions.scheduling.fairshare.account_shares()`: the database sums each owner's decayed usage and
  answers one row per owner (what every scheduler pass with two or more owners waiting reads);
- the baseline, in the same run: the same decayed sum computed in Python over every allocation
  row (`decayed_seconds` per row, as account_shares did before), the way a per-row read scales.

Both must give the same usage per owner (checked, relative 1e-6).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

DAY = 86400


def fill(*, allocations: int, owners: list, device, now) -> None:
    """`allocations` ended allocations of `owners` (round robin) over the last 140 days, bulk
    written; every owner has sessions, of up to 100 allocations each."""
    from datetime import timedelta

    from sessions.models import Allocation, ComputeSession, SessionStatus

    sessions = ComputeSession.objects.bulk_create(
        ComputeSession(
            owner=owners[i % len(owners)], name=f"s{i}", resources={}, request_spec={}, status=SessionStatus.TERMINATED
        )
        for i in range(max(len(owners), allocations // 100))
    )
    span = 140 * DAY
    rows = []
    for i in range(allocations):
        session = sessions[i % len(sessions)]
        end = now - timedelta(seconds=span * i / allocations)
        rows.append(
            Allocation(
                session=session,
                device=device,
                shares="0.5",
                memory=1 << 30,
                procs=10,
                created_at=end - timedelta(hours=1 + i % 12),
                released_at=end,
            )
        )
    Allocation.objects.bulk_create(rows, batch_size=5000)


def python_usage(now) -> dict[int, float]:
    """The baseline: every allocation in the horizon read, its decayed seconds summed in Python."""
    from django.db.models import Q
    from django.utils import timezone

    from sessions.scheduling.fairshare import HORIZON_HALF_LIVES, decayed_seconds, half_life_seconds
    from sessions.models import Allocation

    half_life, now_s = half_life_seconds(), now.timestamp()
    horizon = now - timezone.timedelta(seconds=half_life * HORIZON_HALF_LIVES)
    usage: dict[int, float] = {}
    rows = Allocation.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=horizon)).values_list(
        "session__owner_id", "shares", "created_at", "released_at"
    )
    for owner_id, shares, created_at, released_at in rows:
        end = min(released_at.timestamp() if released_at else now_s, now_s)
        usage[owner_id] = usage.get(owner_id, 0.0) + float(shares) * decayed_seconds(
            start=min(created_at.timestamp(), end), end=end, now=now_s, half_life=half_life
        )
    return usage


def timed(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), max(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--owners", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from accelerators.models import Device
    from benchmarks.database import throwaway_database
    from sessions.scheduling import fairshare
    from sessions.models import Allocation, ComputeSession, Project, SessionStatus
    from tests.seed import make_cluster, mock_gpu

    print(f"fair-share read, {args.owners} owners, median / max of {args.repeat} (ms); {os.cpu_count()} CPU(s)")
    print(f"{'allocations':>12} {'account_shares':>16} {'per-row baseline':>18} {'ratio':>7}")
    with throwaway_database("bench_fairshare"):
        make_cluster(nodes={"bench": [mock_gpu(i) for i in range(8)]})
        device = Device.objects.first()
        owners = [get_user_model().objects.create_user(f"u{i}") for i in range(args.owners)]
        for p in range(10):
            Project.objects.create(name=f"p{p}").members.set(owners[p : args.owners // 2 : 10])
        for owner in owners:  # one running allocation each
            running = ComputeSession.objects.create(
                owner=owner, name="live", resources={}, request_spec={}, status=SessionStatus.RUNNING
            )
            Allocation.objects.create(session=running, device=device, shares="0.25", memory=1 << 30, procs=10)
        now = timezone.now()
        filled = 0
        for size in sorted(args.allocations):
            fill(allocations=size - filled, owners=owners, device=device, now=now)
            filled = size
            db_ms, db_max, shares = timed(lambda: fairshare.account_shares(now=now), args.repeat)
            py_ms, py_max, usage = timed(lambda: python_usage(now), args.repeat)
            by_name = {a.name: a.usage for a in shares if a.kind == "user"}
            for owner in owners[args.owners // 2 :]:  # the owners in no project: their own accounts
                expected = usage.get(owner.pk, 0.0)
                assert abs(by_name[owner.username] - expected) <= 1e-6 * max(expected, 1.0), owner.username
            print(f"{size:>12,} {db_ms:>9.1f} / {db_max:<6.1f} {py_ms:>10.1f} / {py_max:<7.1f} {py_ms / db_ms:>6.1f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
