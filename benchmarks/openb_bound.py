"""How much GPU the fractional pods of an openb run leave unusable, packed offline.

    python benchmarks/openb_bound.py [--trace default] [--seeds 42-51] [--json]

At 100 % arrival the whole-GPU pods that arrived outnumber the idle GPUs left (openb: every
policy has failed whole-GPU pods by then), so the GPU left unallocated is the room left on
GPUs that hold fractional (SHARE) pods. This packs the SHARE pods that arrive by 100 % (openb.py's
inflation, the same seeds) into 1,000-milli-GPU devices two ways, ignoring CPU, memory, GPU
models and arrival order: first-fit decreasing, and the LP bound (the cutting-stock LP of
packing.py, a lower bound on the devices any packing of all of them needs). Their room left,
as % of the cluster's GPU, is what a placement policy that places all of those pods cannot
beat (LP) or would do with the whole run known in advance (FFD). A policy can still leave
less: SHARE pods that find no room late in the run fail and leave no room behind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from accelerators.allocation.cluster import SHARE  # noqa: E402
from accelerators.allocation.packing import solve_packing_plan  # noqa: E402
from benchmarks.openb import MILLI, inflate, load_nodes, load_pods, parse_seeds  # noqa: E402


def arrived_shares(trace: str, seed: int, capacity: int) -> list[int]:
    """SHARE amounts (milli-GPU) of the pods that arrive until the GPU requested reaches `capacity`."""
    amounts, arrived = [], 0
    for pod in inflate(load_pods(trace), seed, capacity):
        arrived += pod.gpu_amount
        if arrived > capacity:
            break
        if pod.kind == SHARE:
            amounts.append(pod.amount)
    return amounts


def first_fit_decreasing_room(amounts: list[int]) -> int:
    """Room left (milli-GPU) on the devices first-fit decreasing opens for `amounts`."""
    room: list[int] = []
    for amount in sorted(amounts, reverse=True):
        for i, left in enumerate(room):
            if left >= amount:
                room[i] -= amount
                break
        else:
            room.append(MILLI - amount)
    return sum(room)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    capacity = int(load_nodes().cap.sum())
    rows = []
    for seed in parse_seeds(args.seeds):
        amounts = arrived_shares(args.trace, seed, capacity)
        plan = solve_packing_plan(MILLI, Counter(amounts))
        rows.append(
            {
                "seed": seed,
                "share_pods": len(amounts),
                "ffd_room_pct": 100 * first_fit_decreasing_room(amounts) / capacity,
                "lp_room_pct": 100 * (plan.bins * MILLI - sum(amounts)) / capacity,
            }
        )
    summary = {key: statistics.mean(r[key] for r in rows) for key in ("ffd_room_pct", "lp_room_pct")}
    if args.json:
        print(json.dumps({"trace": args.trace, "seeds": [r["seed"] for r in rows], "runs": rows, "mean": summary}))
        return 0
    for r in rows:
        print(
            f"seed {r['seed']}: {r['share_pods']} SHARE pods, room left by first-fit decreasing "
            f"{r['ffd_room_pct']:.3f} %, LP bound {r['lp_room_pct']:.3f} %"
        )
    print(f"mean: first-fit decreasing {summary['ffd_room_pct']:.3f} %, LP bound {summary['lp_room_pct']:.3f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
