"""ETAs on a mixed batch queue (issue 32.3): how many starts fall inside their band, and how far
from it, with the console's history keying against the old one, measured in the same run.

    python benchmarks/queue_bands.py [--seed 7] [--jobs 600] [--gpus 8] [--load 0.9] [--cancelled 0.1]
                               [--preempted 0.05] [--failed 0.03] [--grace 15] [--backfill 3]
                               [--predictions 200] [--json]

What happens, all through the project's own pure code (no database):

1. The trace: --jobs batch jobs of five kinds (a command, an image, a request and a project each:
   4 s evaluations on 0.5 fGPU, 20 s and 90 s trainings on 1 and 2 GPUs, 45 s sweeps, 10 s
   renders on 0.25 fGPU), launched by four users who each run two or three kinds — so one owner's
   history mixes short and long jobs — arriving as a Poisson stream that asks --load times the
   cluster's GPU-seconds. Each run lasts its kind's length ±10 %; --cancelled of them are
   cancelled after 5-60 % of it, --preempted preempted after 10-90 % of it (with a notice --grace
   seconds before the stop, as `sessions.scheduling.preemption` gives one: the session's `preempt_at`),
   --failed fail early.
2. The truth: the trace replayed on --gpus GPUs (nodes of 4 GPUs, 1 fGPU = 1 GPU) by
   `accelerators.allocation.replay.replay` over `core.place` (benchmarks/eta.py's `Room`: the
   real pass's order, same-shape short-cut and backfill rule), each job holding its room for as
   long as it really ran.
3. The estimates: for jobs that had to wait when they arrived (at most --predictions, evenly
   spread, after the first tenth of the trace), the band the console would have given at that
   moment (benchmarks/eta.py's `estimate`, the same two replays: every running job ending at the
   low, then the high end of its band), under two keyings of the runtime history of the jobs
   that ended before then:
   - "console": `accelerators.allocation.runtime_history.History` — what `sessions.scheduling.eta` reads:
     keyed by command, image, request and project, falling back to coarser keys; the band from
     completed runs, its early end sooner where runs of the same key were cut short that early
     (`early_ends`); a running job under a preemption notice ends at its `preempt_at`, known
     before any history;
   - "completed": the same with completed runs only (`early_ends` off);
   - "baseline": the keying before issue 32 — every ended run, cancelled and preempted ones
     included, by owner and image, else by owner; no known ends.
4. The score, per keying: the share of estimates whose true start fell inside the band (1 s of
   slack; no band counts as outside), before and after it, with no band, and the mean and
   median |start - band middle| in seconds, over the estimates that gave a band.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from accelerators.allocation import cluster, core  # noqa: E402
from accelerators.allocation import replay as pure  # noqa: E402
from accelerators.allocation import runtime_history as history  # noqa: E402
from benchmarks.eta import MILLI, Room, start_against, two_replays  # noqa: E402

GPUS_PER_NODE = 4

# kind → (command, image, request, mean seconds)
KINDS = {
    "eval": ("python eval.py", "pytorch:2.3", ("shares", "0.5"), 4.0),
    "train": ("python train.py --small", "pytorch:2.3", ("device", "1"), 20.0),
    "train-big": ("python train.py --big", "pytorch:2.3", ("device", "2"), 90.0),
    "sweep": ("python sweep.py", "jax:0.4", ("device", "1"), 45.0),
    "render": ("bash render.sh", "blender:4.1", ("shares", "0.25"), 10.0),
}
# user → (project, the kinds they launch)
USERS = {
    "alice": ("vision", ["eval", "train"]),
    "bob": ("nlp", ["train-big", "sweep"]),
    "carol": ("", ["render", "eval", "train"]),
    "dave": ("vision", ["sweep", "render"]),
}


@dataclass
class Job:
    """One batch run of the trace: `ran` seconds it held its room (its kind's length, or until it
    was cancelled, preempted or failed: `outcome`), `notice` seconds before its end that end was
    known (a preemption's grace; 0: not known)."""

    key: str
    arrives: float
    ran: float
    outcome: str
    request: core.ResourceRequest
    shape: str
    owner: str
    command: str
    image: str
    project: str
    notice: float = 0.0

    @property
    def job(self) -> history.Job:
        return history.Job(self.command, self.image, self.shape, self.project or f"user {self.owner}")


def make_trace(args) -> list[Job]:
    rng = random.Random(args.seed)
    gpu_seconds = statistics.mean(
        float(KINDS[k][2][1]) * KINDS[k][3] for _, kinds in USERS.values() for k in kinds
    )  # per job, over the users' mix
    gap = gpu_seconds / (args.gpus * args.load)  # mean seconds between arrivals
    jobs, t = [], 0.0
    for i in range(args.jobs):
        t += rng.expovariate(1.0 / gap)
        owner = rng.choice(sorted(USERS))
        project, kinds = USERS[owner]
        kind = rng.choice(kinds)
        command, image, (style, amount), mean = KINDS[kind]
        request = core.ResourceRequest(kind=style, amount=Decimal(amount), cpu=1, mem=1)  # type: ignore[arg-type]
        length = mean * rng.uniform(0.9, 1.1)
        roll, ran, outcome, notice = rng.random(), length, history.COMPLETED, 0.0
        if roll < args.cancelled:
            ran, outcome = length * rng.uniform(0.05, 0.6), history.CANCELLED
        elif roll < args.cancelled + args.preempted:
            ran, outcome, notice = length * rng.uniform(0.1, 0.9), history.PREEMPTED, args.grace
        elif roll < args.cancelled + args.preempted + args.failed:
            ran, outcome = length * rng.uniform(0.0, 0.3), history.FAILED
        jobs.append(Job(f"j{i:05d}", t, ran, outcome, request, f"{style}:{amount}", owner, command, image, project, notice))
    return jobs


def make_nodes(gpus: int) -> list[core.NodeState]:
    return [
        core.NodeState(
            node_id=f"n{n}",
            cpu_total=64,
            mem_total=1 << 20,
            devices=tuple(
                core.DeviceState(device_id=f"n{n}/{i}", memory_total=MILLI, proc_total=MILLI, index=i)
                for i in range(GPUS_PER_NODE)
            ),
        )
        for n in range(max(1, gpus // GPUS_PER_NODE))
    ]


class Histories:
    """The runtime histories of the jobs that ended before a moment, under both keyings, grown in
    order of their ends (`upto`)."""

    def __init__(self, jobs: list[Job], starts: dict[str, float | None]):
        ended = sorted((starts[j.key] + j.ran, j.key, j) for j in jobs if starts.get(j.key) is not None)  # type: ignore[operator]
        self.ends = [e for e, _, _ in ended]
        self.jobs = [j for _, _, j in ended]
        self.taken = 0
        self.console = history.History()
        self.baseline: dict[tuple, list[float]] = {}

    def upto(self, t: float) -> None:
        for job in self.jobs[self.taken : bisect.bisect_right(self.ends, t)]:
            self.console.add(job.job, job.ran, job.outcome)
            for key in ((job.owner, job.image), (job.owner, None)):  # sessions.scheduling.eta before issue 32
                self.baseline.setdefault(key, []).append(job.ran)
        self.taken = max(self.taken, bisect.bisect_right(self.ends, t))

    def baseline_band(self, job: Job, elapsed: float) -> tuple[float, float] | None:
        same = self.baseline.get((job.owner, job.image), [])
        runs = same if len(same) >= pure.HISTORY_MIN else self.baseline.get((job.owner, None), [])
        return pure.remaining_band(runs, elapsed, low=pure.HISTORY_BAND[0], high=pure.HISTORY_BAND[1], minimum=pure.HISTORY_MIN)

    def console_band(
        self, job: Job, elapsed: float, at: float, end: float, early_ends: bool = True
    ) -> tuple[float, float] | None:
        if job.notice and at >= end - job.notice:  # under notice: its preempt_at is known (sessions.scheduling.eta.expected_end)
            return end - at, end - at
        return self.console.band(job.job, elapsed, early_ends=early_ends)[0]

    def completed_band(self, job: Job, elapsed: float, at: float, end: float) -> tuple[float, float] | None:
        return self.console_band(job, elapsed, at, end, early_ends=False)

    def baseline_at(self, job: Job, elapsed: float, at: float, end: float) -> tuple[float, float] | None:
        return self.baseline_band(job, elapsed)


Band = Callable[[Job, float, float, float], "tuple[float, float] | None"]


def estimate(at, key, jobs, order, starts, where, nodes, args, band: Band) -> pure.Band:
    """The band the console would give job `key` at `at`: the two replays of `sessions.scheduling.eta`
    (benchmarks/eta.py's `estimate`), with each job's runtime band from `band(job, elapsed, at,
    true end)`."""
    running = [k for k in order if starts.get(k) is not None and starts[k] <= at < starts[k] + jobs[k].ran]
    waiting = [k for k in order if jobs[k].arrives <= at and (starts.get(k) is None or starts[k] > at)]
    ends = {}
    for k in running:
        b = band(jobs[k], at - starts[k], at, starts[k] + jobs[k].ran)
        ends[k] = None if b is None else (at + b[0], at + b[1])
    runtimes = {k: band(jobs[k], 0.0, at, float("inf")) for k in waiting}
    room = lambda: Room(nodes, jobs, "binpack", cluster.Workload())  # noqa: E731
    return two_replays(key, jobs, room, running, where, waiting, runtimes, ends, at, args.backfill)


def score(bands: list[tuple[pure.Band, float]]) -> dict:
    counts = {"in_band": 0, "early": 0, "late": 0, "no_band": 0}
    errors, widths = [], []
    for band, actual in bands:
        if band.earliest is None or band.latest is None:
            counts["no_band"] += 1
            continue
        counts[start_against(band, actual)] += 1
        errors.append(abs(actual - (band.earliest + band.latest) / 2))
        widths.append(band.latest - band.earliest)
    n = len(bands)
    return {
        "in_band_pct": round(100 * counts["in_band"] / n, 1) if n else None,
        "counts": counts,
        "error_s_mean": round(statistics.mean(errors), 1) if errors else None,
        "error_s_median": round(statistics.median(errors), 1) if errors else None,
        "band_width_s_median": round(statistics.median(widths), 1) if widths else None,
    }


WORDS = {
    "console": "by command, image, request, project; completed runs, cut-short ones on the early side; known ends",
    "completed": "the same, completed runs only",
    "baseline": "by owner and image, every run (before issue 32)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all, nodes of 4")
    parser.add_argument("--load", type=float, default=0.9, help="GPU-seconds asked per GPU-second of the cluster")
    parser.add_argument("--cancelled", type=float, default=0.10, help="share of runs cancelled")
    parser.add_argument("--preempted", type=float, default=0.05, help="share of runs preempted")
    parser.add_argument("--failed", type=float, default=0.03, help="share of runs that fail")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds between a preemption notice and the stop")
    parser.add_argument("--backfill", type=int, default=3, help="FGPU_BACKFILL_LIMIT")
    parser.add_argument("--predictions", type=int, default=200, help="estimates made at most")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    trace = make_trace(args)
    jobs = {j.key: j for j in trace}
    order = [j.key for j in trace]
    nodes = make_nodes(args.gpus)
    began = time.perf_counter()
    truth_room = Room(nodes, jobs, "binpack", cluster.Workload())
    truth = pure.replay(
        [pure.Queued(j.key, j.shape, runtime=j.ran, arrives=j.arrives) for j in trace],
        ends={},
        room=truth_room,
        now=0.0,
        backfill_limit=args.backfill,
        max_events=10**7,
    )
    truth_s = time.perf_counter() - began
    starts = {k: s.at for k, s in truth.starts.items()}
    warm = trace[len(trace) // 10].arrives if trace else 0.0
    waited = [j for j in trace if j.arrives >= warm and starts.get(j.key) is not None and starts[j.key] > j.arrives]  # type: ignore[operator]
    step = max(1, len(waited) // args.predictions) if args.predictions else 1
    sample = waited[::step][: args.predictions]
    histories = Histories(trace, starts)
    ways: dict[str, Band] = {
        "console": histories.console_band,
        "completed": histories.completed_band,
        "baseline": histories.baseline_at,
    }
    scored: dict[str, list[tuple[pure.Band, float]]] = {name: [] for name in ways}
    began = time.perf_counter()
    for job in sample:
        histories.upto(job.arrives)
        actual = starts[job.key]
        assert actual is not None
        for name, way in ways.items():
            band = estimate(job.arrives, job.key, jobs, order, starts, truth_room.where, nodes, args, way)
            scored[name].append((band, actual))
    estimate_s = time.perf_counter() - began
    waits = [starts[j.key] - j.arrives for j in waited]  # type: ignore[operator]
    outcomes = {o: sum(1 for j in trace if j.outcome == o) for o in history.OUTCOMES}
    result = {
        "seed": args.seed,
        "jobs": len(trace),
        "outcomes": outcomes,
        "gpus": sum(len(n.devices) for n in nodes),
        "load": args.load,
        "backfill_limit": args.backfill,
        "waited": len(waited),
        "wait_s_median": round(statistics.median(waits), 1) if waits else None,
        "estimates": len(sample),
        **{name: score(bands) for name, bands in scored.items()},
        "truth_s": round(truth_s, 2),
        "estimate_ms_mean": round(1000 * estimate_s / max(len(ways) * len(sample), 1), 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print("\n".join(report(result, args)))
    return 0


def report(result: dict, args) -> list[str]:
    """The lines the benchmark prints (results/queue_bands.txt)."""
    outcomes = ", ".join(f"{n} {o}" for o, n in result["outcomes"].items())
    lines = [
        f"mixed batch trace (seed {args.seed}): {result['jobs']} jobs on {result['gpus']} GPUs at load {args.load} "
        f"({outcomes}), backfill limit {args.backfill}",
        f"  {result['waited']} jobs waited (median {result['wait_s_median']} s); "
        f"{result['estimates']} estimates at their arrival",
    ]
    for name, words in WORDS.items():
        s, c = result[name], result[name]["counts"]
        lines.append(f"  {name:9} ({words}):")
        lines.append(
            f"            started within the band {s['in_band_pct']} % (before: {c['early']}, after: {c['late']}, "
            f"no band: {c['no_band']}); |start - band middle| mean {s['error_s_mean']} s, median {s['error_s_median']} s; "
            f"band width median {s['band_width_s_median']} s"
        )
    lines.append(f"  truth replay {result['truth_s']} s; {result['estimate_ms_mean']} ms per estimate")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
