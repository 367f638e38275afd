"""Calibration of the "When will I start?" estimate (issue 17.3) on Alibaba's openb trace.

    python benchmarks/eta.py [--trace default] [--gpus 16] [--start-day 119] [--days 3] [--warmup-days 1]
                             [--policy fgd-plus] [--backfill 8] [--predictions 400] [--band 0.05,0.95] [--json]

What happens, all through the project's own pure code:

1. The truth: the trace's GPU pods (those with a scheduled and a deletion time) that arrive in
   the window (`creation_time` from --start-day for --days) are replayed on a slice of the
   openb cluster (every k-th node of the node list, about --gpus GPUs: the cluster's mix in small)
   by `accelerators.allocation.replay.replay` — the console's replay engine, with the real
   pass's order, same-shape short-cut and backfill rule — over `core.place` under --policy
   (the allocator the scheduler runs), each pod holding its room for its own duration
   (`deletion_time - scheduled_time`). The slice is small on purpose: at full size the trace
   never queues (it keeps at most about 66 GPUs busy).
2. The estimate: for pods that had to wait when they arrived (after --warmup-days, at most
   --predictions of them, evenly spread), the estimate the console would have given at that
   moment: the same replay from then, over the pods waiting then (in queue order) and the pods
   running then (where the truth put them), each running pod ending at its remaining runtime's
   band from the history of pods that ended before then, as `sessions.scheduling.eta.expected_end` does
   for a batch session (`replay.remaining_band`, quantiles `replay.HISTORY_BAND`, at least
   `replay.HISTORY_MIN` runtimes): first pods of the same request shape and QoS (the console's
   "same owner and image"), else pods of the same QoS (its "same owner"); without either, no
   known end. Waiting pods run for their own band once started. No future arrivals are known.
3. The score: the fraction of those pods whose true start fell in their band [earliest,
   latest] (1 s of slack), next to those that started before it, after it, and those given no
   band ("unknown").

openb has no owners or images; the request shape and QoS stand for them. Backfill counts
start at 0 in each estimate (the console reads them from the database).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import statistics
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from accelerators.allocation import cluster, core  # noqa: E402
from accelerators.allocation import replay as pure  # noqa: E402
from accelerators.allocation.errors import InsufficientResource, NeverSchedulable  # noqa: E402
from accelerators.allocation.reservation import Holding, Reservation, Reservations, reservation_find  # noqa: E402
from benchmarks.openb import TRACE_DIR  # noqa: E402

DAY = 86400.0
MILLI = 1000
SETTINGS = core.FractionalSettings(unit_mem=MILLI, unit_proc=MILLI, quantum=Decimal("0.001"))  # 1 fGPU = 1 GPU


@dataclass
class Pod:
    key: str
    arrives: float
    duration: float
    request: core.ResourceRequest
    shape: str  # request shape: the console's "image"
    qos: str  # the console's "owner"


def load_pods(trace: str, start: float, end: float) -> list[Pod]:
    pods = []
    for r in csv.DictReader(open(TRACE_DIR / f"openb_pod_list_{trace}.csv")):
        if not r.get("scheduled_time") or not r.get("deletion_time") or int(r["num_gpu"]) == 0:
            continue
        arrives = float(r["creation_time"])
        duration = float(r["deletion_time"]) - float(r["scheduled_time"])
        if not start <= arrives < end or duration <= 0:
            continue
        num, milli = int(r["num_gpu"]), int(r["gpu_milli"])
        cpu, mem = int(r["cpu_milli"]), int(r["memory_mib"])
        if milli < MILLI:
            request = core.ResourceRequest(kind="shares", amount=Decimal(milli) / MILLI, cpu=cpu, mem=mem)
        else:
            request = core.ResourceRequest(kind="device", amount=Decimal(num), cpu=cpu, mem=mem)
        pods.append(Pod(r["name"], arrives, duration, request, f"{num}x{milli}|{cpu}|{mem}", r.get("qos", "")))
    return sorted(pods, key=lambda p: (p.arrives, p.key))


def load_nodes(gpus: int) -> list[core.NodeState]:
    """Every k-th openb GPU node (k = the cluster's GPUs / `gpus`: the whole cluster's mix of 2-,
    4- and 8-GPU nodes in small), CPU in milli-cores, memory in MiB, each GPU 1000 units of
    memory and of SMs (1 fGPU)."""
    rows = [r for r in csv.DictReader(open(TRACE_DIR / "openb_node_list_gpu_node.csv")) if int(r["gpu"]) > 0]
    step = max(1, round(sum(int(r["gpu"]) for r in rows) / gpus))
    chosen = rows[::step]
    return [
        core.NodeState(
            node_id=r["sn"],
            cpu_total=int(r["cpu_milli"]),
            mem_total=int(r["memory_mib"]),
            devices=tuple(
                core.DeviceState(device_id=f"{r['sn']}/{i}", memory_total=MILLI, proc_total=MILLI, index=i)
                for i in range(int(r["gpu"]))
            ),
        )
        for r in chosen
    ]


class Room:
    """`replay.ReservingRoom` over `core.place` on the slice, with the index kept current as the
    scheduler's pass keeps it (`core.node_row`): a pod past the backfill limit reserves as the
    pass's sessions do (`reservation.reservation_find`), and pods have no time limit (as a
    console without a maximum lifetime), so none runs on reserved devices. Remembers where each
    pod went (`where`)."""

    def __init__(self, nodes: list[core.NodeState], pods: dict[str, Pod], policy: str, workload: cluster.Workload):
        self.nodes = list(nodes)
        self.rows = {n.node_id: i for i, n in enumerate(self.nodes)}
        self.index = core.cluster_index(self.nodes, SETTINGS)
        self.pods, self.policy, self.workload = pods, policy, workload
        self.held: dict[str, core.Placement] = {}
        self.where: dict[str, core.Placement] = {}

    def place(self, key: str, reservations: Reservations | None = None, end: float | None = None) -> tuple[str, str]:
        request = self.pods[key].request
        workload = None
        if self.policy in cluster.FRAGMENTATION_AWARE:
            self.workload.observe(core.request_shape(request, SETTINGS))
            workload = self.workload

        def place(nodes: list[core.NodeState] | None) -> core.Placement:
            if nodes is None:
                return core.place(self.nodes, request, SETTINGS, policy=self.policy, index=self.index, workload=workload)
            return core.place(nodes, request, SETTINGS, policy=self.policy, workload=workload)

        try:
            if reservations is None:
                placement = place(None)
            else:
                placement = reservations.place_around(self.nodes, cpu=request.cpu, mem=request.mem, end=end, place=place)
        except NeverSchedulable as exc:
            return pure.NEVER, str(exc)
        except InsufficientResource as exc:
            return pure.WAITING, str(exc)
        self.take(key, placement)
        return pure.PLACED, ""

    def place_around(self, key: str, reservations: Reservations, end: float | None) -> tuple[str, str]:
        return self.place(key, reservations, end)

    def reserve(self, key: str, *, name: str, ends: dict, now: float, earlier: list[Reservation]) -> Reservation | None:
        holdings = {
            k: Holding(p.node_id, self.pods[k].request.cpu, self.pods[k].request.mem, p.grants) for k, p in self.held.items()
        }
        return reservation_find(
            self.nodes,
            key=key,
            name=name,
            request=self.pods[key].request,
            settings=SETTINGS,
            options={"policy": self.policy},
            holdings=holdings,
            ends=ends,
            now=now,
            earlier=earlier,
        )

    def take(self, key: str, placement: core.Placement) -> None:
        row = self.rows[placement.node_id]
        self._set(row, core.apply_placement(self.nodes[row], self.pods[key].request, placement))
        self.held[key] = self.where[key] = placement

    def release(self, key: str) -> None:
        placement = self.held.pop(key, None)
        if placement is None:
            return
        row, request = self.rows[placement.node_id], self.pods[key].request
        self._set(row, core.release_placement(self.nodes[row], cpu=request.cpu, mem=request.mem, grants=placement.grants))

    def _set(self, row: int, node: core.NodeState) -> None:
        self.nodes[row] = node
        self.index.set_row(row, **core.node_row(node, SETTINGS))


class History:
    """Runtimes of pods that ended, by (shape, qos) and by qos, in order of their ends."""

    def __init__(self, pods: list[Pod], starts: dict[str, float]):
        ended = sorted(
            ((starts[p.key] + p.duration, p) for p in pods if starts.get(p.key) is not None),
            key=lambda pair: (pair[0], pair[1].key),
        )
        self.ends = [e for e, _ in ended]
        self.pods = [p for _, p in ended]

    def before(self, t: float, pod: Pod) -> list[float]:
        upto = bisect.bisect_right(self.ends, t)
        window = t - 30 * DAY  # sessions.scheduling.eta.HISTORY_DAYS
        same = [
            p.duration
            for e, p in zip(self.ends[:upto], self.pods[:upto])
            if e >= window and p.shape == pod.shape and p.qos == pod.qos
        ]
        if len(same) >= pure.HISTORY_MIN:
            return same
        return [p.duration for e, p in zip(self.ends[:upto], self.pods[:upto]) if e >= window and p.qos == pod.qos]


def estimate(
    at: float,
    pod_key: str,
    pods: dict[str, Pod],
    order: list[str],
    starts: dict[str, float],
    where: dict[str, core.Placement],
    nodes,
    args,
    history: History,
) -> pure.Band:
    """The band the console would have given `pod_key` at `at` (module docstring, step 2); `where`:
    where the truth placed each pod."""
    running = [k for k in order if starts.get(k) is not None and starts[k] <= at < starts[k] + pods[k].duration]
    waiting = [k for k in order if pods[k].arrives <= at and (starts.get(k) is None or starts[k] > at)]
    low, high = args.band
    bands = {}
    for k in running:
        band = pure.remaining_band(history.before(at, pods[k]), at - starts[k], low=low, high=high, minimum=pure.HISTORY_MIN)
        bands[k] = None if band is None else (at + band[0], at + band[1])
    runtimes = {}
    for k in waiting:
        band = pure.remaining_band(history.before(at, pods[k]), 0.0, low=low, high=high, minimum=pure.HISTORY_MIN)
        runtimes[k] = band

    def room() -> Room:
        seen = cluster.Workload()  # the request shapes seen so far, as the group's PlacementShape counts
        for k in order:
            if pods[k].arrives > at:
                break
            seen.observe(core.request_shape(pods[k].request, SETTINGS))
        return Room(nodes, pods, args.policy, seen)

    return two_replays(pod_key, pods, room, running, where, waiting, runtimes, bands, at, args.backfill)


def two_replays(key, pods, room, running, where, waiting, runtimes, ends, at: float, backfill: int) -> pure.Band:
    """`key`'s band from the console's two replays at `at` (`sessions.scheduling.eta`): on a fresh `room()`
    with the `running` pods where the truth put them (`where`), the `waiting` ones queued for
    their `runtimes` band's low, then high end (None: no known end), the running ones ending at
    their `ends` band's (absolute times; None: no known end)."""
    results = []
    for late in (False, True):
        held = room()
        for k in running:
            held.take(k, where[k])
        queue = [pure.Queued(k, pods[k].shape, runtime=None if runtimes[k] is None else runtimes[k][int(late)]) for k in waiting]
        until = {k: None if ends[k] is None else ends[k][int(late)] for k in running}
        results.append(pure.replay(queue, ends=until, room=held, now=at, backfill_limit=backfill).starts[key])
    return pure.eta_band(*results)


def start_against(band: pure.Band, actual: float, slack: float = 1.0) -> str:
    """Where a true start fell against a band with both ends: "early", "late" or "in_band"
    (within `slack` seconds of it)."""
    assert band.earliest is not None and band.latest is not None
    if actual < band.earliest - slack:
        return "early"
    return "late" if actual > band.latest + slack else "in_band"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument(
        "--gpus", type=int, default=16, help="about how many GPUs the slice has (every k-th node: 16 gives 4 nodes, 8 GPUs)"
    )
    parser.add_argument("--start-day", type=float, default=119)
    parser.add_argument("--days", type=float, default=3)
    parser.add_argument("--warmup-days", type=float, default=1, help="arrivals not scored at the start")
    parser.add_argument("--policy", default="fgd-plus", choices=list(cluster.POLICIES))
    parser.add_argument("--backfill", type=int, default=8, help="FGPU_BACKFILL_LIMIT")
    parser.add_argument("--predictions", type=int, default=400, help="estimates made at most")
    parser.add_argument(
        "--band",
        default=",".join(map(str, pure.HISTORY_BAND)),
        type=lambda text: tuple(float(x) for x in text.split(",")),
        help="history quantiles LOW,HIGH (the console's: replay.HISTORY_BAND)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    start = args.start_day * DAY
    pods_list = load_pods(args.trace, start, start + args.days * DAY)
    pods = {p.key: p for p in pods_list}
    order = [p.key for p in pods_list]
    nodes = load_nodes(args.gpus)
    began = time.perf_counter()
    truth_room = Room(nodes, pods, args.policy, cluster.Workload())
    truth = pure.replay(
        [pure.Queued(p.key, p.shape, runtime=p.duration, arrives=p.arrives) for p in pods_list],
        ends={},
        room=truth_room,
        now=start,
        backfill_limit=args.backfill,
        max_events=10**7,
    )
    truth_s = time.perf_counter() - began
    starts = {k: s.at for k, s in truth.starts.items()}
    waited = [
        p
        for p in pods_list
        if p.arrives >= start + args.warmup_days * DAY and starts.get(p.key) is not None and starts[p.key] > p.arrives
    ]
    step = max(1, len(waited) // args.predictions) if args.predictions else 1
    sample = waited[::step][: args.predictions]
    history = History(pods_list, starts)
    counts = {"in_band": 0, "early": 0, "late": 0, "unknown": 0, "never": 0}
    widths, errors = [], []
    began = time.perf_counter()
    for pod in sample:
        band = estimate(pod.arrives, pod.key, pods, order, starts, truth_room.where, nodes, args, history)
        actual = starts[pod.key]
        if band.outcome == pure.NEVER:
            counts["never"] += 1
        elif band.earliest is None or band.latest is None:
            counts["unknown"] += 1
        else:
            counts[start_against(band, actual)] += 1
        if band.earliest is not None and band.latest is not None:
            widths.append((band.latest - band.earliest) / 60)
            mid = (band.earliest + band.latest) / 2
            errors.append(abs(actual - mid) / 60)
    estimate_s = time.perf_counter() - began
    scored = len(sample)
    waits = [(starts[p.key] - p.arrives) / 60 for p in waited]
    result = {
        "trace": args.trace,
        "window_days": [args.start_day, args.start_day + args.days],
        "gpus": sum(len(n.devices) for n in nodes),
        "nodes": len(nodes),
        "policy": args.policy,
        "backfill_limit": args.backfill,
        "pods": len(pods_list),
        "started": sum(1 for s in starts.values() if s is not None),
        "waited": len(waited),
        "wait_min_median": round(statistics.median(waits), 1) if waits else None,
        "estimates": scored,
        "history_band": list(args.band),
        "in_band_pct": round(100 * counts["in_band"] / scored, 1) if scored else None,
        "counts": counts,
        "band_width_min_median": round(statistics.median(widths), 1) if widths else None,
        "midpoint_error_min_median": round(statistics.median(errors), 1) if errors else None,
        "truth_s": round(truth_s, 1),
        "estimate_ms_mean": round(1000 * estimate_s / max(scored, 1), 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"openb {args.trace}, days {args.start_day:g}–{args.start_day + args.days:g}: {result['pods']} GPU pods on "
        f"{result['nodes']} nodes / {result['gpus']} GPUs ({args.policy}, backfill limit {args.backfill})"
    )
    print(
        f"  {result['waited']} pods waited after the warm-up (median wait {result['wait_min_median']} min); "
        f"{scored} estimates made at their arrival"
    )
    print(
        f"  started within the ETA band: {result['in_band_pct']} % "
        f"(before it: {counts['early']}, after it: {counts['late']}, no band: {counts['unknown']}, "
        f"never: {counts['never']})"
    )
    print(
        f"  band width median {result['band_width_min_median']} min; |start - band middle| median "
        f"{result['midpoint_error_min_median']} min; history quantiles {args.band}"
    )
    print(f"  truth replay {result['truth_s']} s; {result['estimate_ms_mean']} ms per estimate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
