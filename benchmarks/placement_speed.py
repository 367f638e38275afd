"""Placements per second of the pure placement module on openb's 1,213-node cluster and on a
synthetic 10,000-node cluster built from the same node specs.

    python benchmarks/placement_speed.py [--policy NAME ...] [--load 50] [--count 1000] [--json]

Method: each cluster is first filled to `--load` % of its GPU with openb pods (default trace,
shuffled with seed 42, drawn with replacement as needed) under binpack, the cheapest policy;
then, under each policy on a copy of that state, 100 more pods are placed untimed (warming
what a running scheduler keeps: fgd's F rows, fgd-plus's packing plan, the imports) and
`--count` more are placed and timed. The
two clusters are measured in the same run, so the ratio (cost per placement on 10,000 nodes
÷ cost on 1,213) is fair on a shared machine. The acceptance bar is a ratio ≤ 3.
Also timed: `core.place` with a kept index (the scheduler's path, Decimal accounting and the
exact per-node device choice) for fGPU requests on the 1,213-node inventory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from decimal import Decimal
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from accelerators.allocation import cluster, core  # noqa: E402
from benchmarks.openb import inflate, load_nodes, load_pods  # noqa: E402

GiB = 1 << 30
WARMUP = 100  # untimed placements before each timed run


def synthetic(base: cluster.ClusterIndex, size: int, seed: int = 7) -> cluster.ClusterIndex:
    """`size` nodes drawn with replacement from `base`'s node specs (model, CPU, memory, GPUs)."""
    rows = np.random.default_rng(seed).integers(len(base), size=size)
    names = [f"syn-{i:05d}" for i in range(size)]
    inverse = {v: k for k, v in base.model_ids.items()}
    return cluster.ClusterIndex(
        names=names,
        cpu_total=base.cpu_total[rows],
        mem_total=base.mem_total[rows],
        models=[inverse[int(m)] for m in base.model[rows]],
        cap=base.cap[rows],
    )


def filled(
    index: cluster.ClusterIndex, pods: list[cluster.Shape], load: float
) -> tuple[cluster.ClusterIndex, int, cluster.Workload]:
    """`index` filled to `load` % of its GPU under binpack; returns it, the next pod's position
    and the workload seen."""
    index = index.copy()
    capacity = int(index.cap.sum())
    workload = cluster.Workload()
    allocated = 0
    for i, shape in enumerate(pods):
        if allocated * 100 >= load * capacity:
            return index, i, workload
        workload.observe(shape)
        if index.place(shape, "binpack") is not None:
            allocated += shape.gpu_amount
    return index, len(pods), workload


def time_policy(index, pods, start, count, policy, workload, warmup: int = WARMUP) -> float:
    """Seconds per placement attempt for `count` pods from `start` + `warmup` under `policy`,
    after `warmup` untimed ones on the same copy (imports, fgd's kept F rows and fgd-plus's
    packing plan in place, as in a scheduler that has been running)."""
    index = index.copy()
    workload = cluster.Workload(workload.counts())
    for shape in pods[start : start + warmup]:
        workload.observe(shape)
        index.place(shape, policy, workload)
    start += warmup
    began = time.perf_counter()
    for shape in pods[start : start + count]:
        workload.observe(shape)
        index.place(shape, policy, workload)
    return (time.perf_counter() - began) / count


def scheduler_path(count: int) -> float:
    """Seconds per `core.place` of a 0.5 fGPU request on 1,213 NodeStates (8 × 16 GiB devices
    or the openb GPU count per node) with a kept index, applying each plan."""
    base = load_nodes()
    settings = core.FractionalSettings(unit_mem=8 * GiB, unit_proc=54, quantum=Decimal("0.01"))
    nodes = []
    for i, name in enumerate(base.names):
        gpus = int((base.cap[i] > 0).sum())
        devices = tuple(
            core.DeviceState(device_id=f"{name}-{j}", memory_total=16 * GiB, proc_total=108, numa_node=j // 4)
            for j in range(gpus)
        )
        nodes.append(
            core.NodeState(
                node_id=name, cpu_total=int(base.cpu_total[i]) // 1000, mem_total=int(base.mem_total[i]) << 20, devices=devices
            )
        )
    index = core.cluster_index(nodes, settings)
    request = core.ResourceRequest(kind="shares", amount=Decimal("0.5"), cpu=2, mem=4 * GiB)
    began = time.perf_counter()
    for _ in range(count):
        placement = core.place(nodes, request, settings, index=index)
        row = index.row[placement.node_id]
        nodes[row] = core.apply_placement(nodes[row], request, placement)
        index.set_row(row, **core.node_row(nodes[row], settings))
    return (time.perf_counter() - began) / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", nargs="+", default=list(cluster.POLICIES))
    parser.add_argument("--load", type=float, default=50.0, help="GPU allocated before timing, %% (default 50)")
    parser.add_argument("--count", type=int, default=1000, help="placements timed per policy and cluster")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = load_nodes()
    pods = load_pods("default")
    results: dict = {"load_pct": args.load, "count": args.count, "policies": {}}
    clusters = {"1213": base, "10000": synthetic(base, 10_000)}
    prepared = {}
    for name, index in clusters.items():
        stream = inflate(pods, 42, int(index.cap.sum()), target=1.0 + (args.load + 10) / 100)
        prepared[name] = (stream, *filled(index, stream, args.load))
    for policy in args.policy:
        row = {}
        for name, (stream, index, start, workload) in prepared.items():
            row[name] = time_policy(index, stream, start, args.count, policy, workload)
        results["policies"][policy] = {
            "placements_per_s_1213": round(1 / row["1213"], 1),
            "placements_per_s_10000": round(1 / row["10000"], 1),
            "cost_ratio_10000_vs_1213": round(row["10000"] / row["1213"], 2),
        }
        if not args.json:
            r = results["policies"][policy]
            print(
                f"{policy:9s} 1,213 nodes {r['placements_per_s_1213']:8.0f}/s   10,000 nodes "
                f"{r['placements_per_s_10000']:8.0f}/s   cost ratio {r['cost_ratio_10000_vs_1213']:.2f}",
                flush=True,
            )
    per = scheduler_path(min(args.count, 1000))
    results["core_place_with_index_per_s_1213"] = round(1 / per, 1)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"core.place (scheduler path, 0.5 fGPU, kept index) on 1,213 nodes: {1 / per:.0f}/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
