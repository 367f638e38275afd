"""Placement quality and speed on Alibaba's GPU-sharing trace "openb" (Weng et al., ATC'23).

    python benchmarks/openb.py [--trace default] [--seeds 42-51] [--policy NAME ...] [--quick] [--json]
                               [--plot PATH]

Method as in the paper's §6.1 ("Monte-Carlo workload inflation"): the cluster is
openb_node_list_gpu_node.csv (1,213 nodes, 6,212 GPUs, CPU and memory per node, GPU model);
for each seed the pod list is shuffled, then pods drawn with replacement are appended until
the requested GPU reaches 130 % of capacity; pods are placed one by one, none departs, and a
pod that does not fit is dropped. `gpu_spec` restricts GPU models; CPU and memory count.
Placement is the project's own placement module (`accelerators.allocation.cluster`), the code
the scheduler runs. Reported per policy: unallocated GPU % at 100 % arrival (mean, sd over
seeds), the arrival level of the first GPU pod that failed, the fragmentation rate at 90 %
arrival (Eq. 6) and placements per second, beside the published FGD / best-fit figures
(fgd_expected_results/derived_summary_by_policy.csv).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from accelerators.allocation.cluster import NONE, SHARE, WHOLE, ClusterIndex, Shape, Workload  # noqa: E402

TRACE_DIR = Path(os.environ.get("FGPU_OPENB_DIR", "/work/shared/traces/openb"))
MILLI = 1000
TRACES = [
    "default",
    "cpu050",
    "cpu100",
    "cpu200",
    "cpu250",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
]
PUBLISHED = {"fgd": "06-FGD", "best-fit": "05-BestFit"}
DEFAULT_POLICIES = ["fgd", "best-fit", "fgd-plus"]


@dataclass
class Run:
    """One seed's outcome. Curves are indexed by arrival level 0..130 (% of GPU capacity)."""

    policy: str
    seed: int
    alloc_curve: list[float] = field(default_factory=list)
    frag_curve: list[float] = field(default_factory=list)
    first_failure: float | None = None
    placements: int = 0
    seconds: float = 0.0

    @property
    def unallocated_at_100(self) -> float:
        return 100.0 - self.alloc_curve[100]


def load_nodes(path: Path | None = None) -> ClusterIndex:
    """The openb GPU cluster as an index: milli-cores, MiB, and 1000 milli-GPU per GPU."""
    rows = list(csv.DictReader(open(path or TRACE_DIR / "openb_node_list_gpu_node.csv")))
    width = max(int(r["gpu"]) for r in rows)
    cap = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        cap[i, : int(r["gpu"])] = MILLI
    return ClusterIndex(
        names=[r["sn"] for r in rows],
        cpu_total=[int(r["cpu_milli"]) for r in rows],
        mem_total=[int(r["memory_mib"]) for r in rows],
        models=[r["model"] for r in rows],
        cap=cap,
    )


def pod_shape(row: dict) -> Shape:
    num, milli = int(row["num_gpu"]), int(row["gpu_milli"])
    models = frozenset(m for m in (row.get("gpu_spec") or "").split("|") if m)
    cpu, mem = int(row["cpu_milli"]), int(row["memory_mib"])
    if num == 0:
        return Shape(NONE, cpu=cpu, mem=mem, models=models)
    if milli < MILLI:
        return Shape(SHARE, cpu=cpu, mem=mem, count=1, amount=milli, models=models)
    return Shape(WHOLE, cpu=cpu, mem=mem, count=num, amount=MILLI, models=models)


def load_pods(trace: str) -> list[Shape]:
    path = Path(trace) if trace.endswith(".csv") else TRACE_DIR / f"openb_pod_list_{trace}.csv"
    return [pod_shape(r) for r in csv.DictReader(open(path))]


def inflate(pods: list[Shape], seed: int, capacity: int, target: float = 1.3) -> list[Shape]:
    """Shuffle `pods`, then append pods drawn with replacement until the GPU requested reaches
    `target` × `capacity` (milli-GPU)."""
    rng = np.random.default_rng(seed)
    order = [pods[i] for i in rng.permutation(len(pods))]
    total = sum(p.gpu_amount for p in order)
    while total < target * capacity:
        p = pods[int(rng.integers(len(pods)))]
        order.append(p)
        total += p.gpu_amount
    return order


def simulate(
    index: ClusterIndex,
    pods: list[Shape],
    policy: str,
    *,
    seed: int = 0,
    levels: int = 130,
    frag_levels: tuple[int, ...] = (90,),
    workload: Workload | None = None,
) -> Run:
    """Place `pods` in order on a copy of `index`, none departing; a pod that does not fit is
    dropped. Records the GPU allocation ratio (%) at each arrival level 0..`levels` (arrived GPU
    demand as % of capacity) and the fragmentation rate (%) at `frag_levels`. The workload p is
    the pods seen so far, unless a fixed `workload` is given."""
    index = index.copy()
    capacity = int(index.cap.sum())
    learn = workload is None
    workload = Workload() if learn else workload
    run = Run(policy=policy, seed=seed, alloc_curve=[0.0] * (levels + 1), frag_curve=[float("nan")] * (levels + 1))
    arrived = allocated = 0
    level = 0
    started = time.perf_counter()
    for shape in pods:
        if learn:
            workload.observe(shape)
        arrived += shape.gpu_amount
        placed = index.place(shape, policy, workload)
        if placed is None:
            if shape.kind != NONE and run.first_failure is None:
                run.first_failure = 100.0 * arrived / capacity
        else:
            run.placements += 1
            allocated += shape.gpu_amount
        while level <= levels and arrived * 100 >= level * capacity:
            run.alloc_curve[level] = 100.0 * allocated / capacity
            if level in frag_levels:
                run.frag_curve[level] = index.fragmentation_rate(workload)
            level += 1
    while level <= levels:  # the workload ended below this level
        run.alloc_curve[level] = 100.0 * allocated / capacity
        level += 1
    run.seconds = time.perf_counter() - started
    return run


def published(trace: str) -> dict:
    """{policy: {"unalloc_100": (mean, sd), "frag_90": mean, "curve": [mean alloc % by level]}}."""
    path = TRACE_DIR / "fgd_expected_results" / "derived_summary_by_policy.csv"
    out: dict = {}
    if not path.exists():
        return out
    name = f"openb_pod_list_{trace}"
    for r in csv.DictReader(open(path)):
        if r["workload"] != name:
            continue
        entry = out.setdefault(r["sc_policy"], {"curve": {}})
        level = int(r["arrived_pct"])
        entry["curve"][level] = float(r["alloc_pct_mean"])
        if level == 100:
            entry["unalloc_100"] = (float(r["unalloc_pct_mean"]), float(r["alloc_pct_sd"]))
        if level == 90:
            entry["frag_90"] = float(r["frag_rate_pct_mean"])
    return out


def summarise(runs: list[Run]) -> dict:
    unalloc = [r.unallocated_at_100 for r in runs]
    failures = [r.first_failure for r in runs if r.first_failure is not None]
    return {
        "unallocated_pct_at_100": round(statistics.fmean(unalloc), 3),
        "unallocated_pct_at_100_sd": round(statistics.stdev(unalloc), 3) if len(unalloc) > 1 else 0.0,
        "first_failure_arrival_pct": round(statistics.fmean(failures), 2) if failures else None,
        "frag_rate_at_90": round(statistics.fmean(r.frag_curve[90] for r in runs), 3),
        "placements_per_s": round(sum(r.placements for r in runs) / max(sum(r.seconds for r in runs), 1e-9), 1),
    }


def plot(path: Path, trace: str, curves: dict[str, list[float]], reference: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    levels = list(range(131))
    for name, curve in curves.items():
        ax.plot(levels[: len(curve)], curve, label=f"{name} (ours)")
    for key, label, style in (("06-FGD", "FGD (published)", "--"), ("05-BestFit", "best-fit (published)", ":")):
        if key in reference:
            pts = sorted(reference[key]["curve"].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color="black" if key == "06-FGD" else "grey", label=label)
    ax.plot([0, 100, 130], [0, 100, 100], color="lightgrey", linewidth=0.8)
    ax.set_xlabel("arrived GPU demand (% of capacity)")
    ax.set_ylabel("GPU allocation ratio (%)")
    ax.set_title(f"openb {trace}: allocation vs arrival (cf. Weng et al. ATC'23 Fig. 7)")
    ax.set_xlim(60, 130)
    ax.set_ylim(60, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            seeds.extend(range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="default", help="trace suffix (default, cpu050, gpushare40, …) or a CSV path")
    parser.add_argument("--seeds", default="42-51", help="seed list, e.g. 42-51 or 42,43")
    parser.add_argument("--policy", nargs="+", action="extend", help=f"policies (default: {' '.join(DEFAULT_POLICIES)})")
    parser.add_argument("--quick", action="store_true", help="one seed of the default trace")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, help="PNG path (default benchmarks/results/openb-<trace>.png)")
    args = parser.parse_args(argv)
    trace = "default" if args.quick else args.trace
    seeds = parse_seeds(args.seeds)[:1] if args.quick else parse_seeds(args.seeds)
    policies = args.policy or DEFAULT_POLICIES
    index = load_nodes()
    pods = load_pods(trace)
    capacity = int(index.cap.sum())
    runs: dict[str, list[Run]] = {p: [] for p in policies}
    for seed in seeds:
        workload = inflate(pods, seed, capacity)
        for policy in policies:
            runs[policy].append(simulate(index, workload, policy, seed=seed))
            if not args.json:
                r = runs[policy][-1]
                print(
                    f"  seed {seed} {policy:9s} unallocated@100 {r.unallocated_at_100:6.2f}%  "
                    f"{r.placements / r.seconds:7.0f} placements/s",
                    file=sys.stderr,
                    flush=True,
                )
    result = {"trace": trace, "seeds": seeds, "policies": {p: summarise(rs) for p, rs in runs.items()}}
    reference = published(trace)
    result["published"] = {
        name: {"unallocated_pct_at_100": reference[key]["unalloc_100"][0], "frag_rate_at_90": reference[key].get("frag_90")}
        for name, key in PUBLISHED.items()
        if key in reference and "unalloc_100" in reference[key]
    }
    plot_path = Path(args.plot) if args.plot else ROOT / "benchmarks" / "results" / f"openb-{Path(trace).stem}.png"
    curves = {p: list(np.mean([r.alloc_curve for r in rs], axis=0)) for p, rs in runs.items()}
    try:
        plot(plot_path, trace, curves, reference)
        result["plot"] = str(plot_path)
    except ImportError:
        result["plot"] = None
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"openb {trace}, seeds {seeds[0]}–{seeds[-1]} ({len(seeds)}), 1,213 nodes / {capacity // MILLI} GPUs")
    print(f"{'policy':12s} {'unalloc@100 %':>16s} {'first fail %':>13s} {'frag@90 %':>10s} {'placements/s':>13s}")
    for name, s in result["policies"].items():
        fail = f"{s['first_failure_arrival_pct']:.1f}" if s["first_failure_arrival_pct"] is not None else "-"
        print(
            f"{name:12s} {s['unallocated_pct_at_100']:8.2f} ± {s['unallocated_pct_at_100_sd']:5.2f} {fail:>13s} "
            f"{s['frag_rate_at_90']:10.2f} {s['placements_per_s']:13.0f}"
        )
    for name, s in result["published"].items():
        frag = f"{s['frag_rate_at_90']:10.2f}" if s["frag_rate_at_90"] is not None else " " * 10
        print(f"{name + ' (pub.)':12s} {s['unallocated_pct_at_100']:8.2f}{'':8s} {'':>13s} {frag}")
    if result["plot"]:
        print(f"plot: {result['plot']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
