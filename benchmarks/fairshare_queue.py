"""The queue over time (issue 17): Alibaba's openb trace replayed, with its own arrivals and
durations, through the scheduler's rules in pure Python with fair share and preemption on.

    python benchmarks/fairshare_queue.py [--trace default] [--nodes 2] [--weights 3,2,1] [--grace 300]
                               [--min-runtime 600] [--half-life-days 7] [--policy binpack] [--limit N] [--json]

What is replayed (every choice stated, all deterministic):

- Pods: the GPU pods of openb_pod_list_<trace>.csv (7,064 in default), in file order; a pod
  arrives at its `creation_time` and runs `deletion_time - creation_time` seconds once started
  (the trace's own fields; its lifetime, the best there is of a duration). CPU-only pods are left
  out (fair share counts fGPU). A pod with `num_gpu` ≥ 2 asks whole devices (`cuda.device`), one
  with one GPU asks `gpu_milli` / 1000 fGPU (1 fGPU = one GPU here); cores are `cpu_milli`
  rounded up, memory `memory_mib`.
- Cluster: the first `--nodes` (default 2) nodes of openb_node_list_gpu_node.csv with 8 GPUs
  (G2: 96 cores, 384 GiB), 16 GPUs. The whole trace on its 6,212 GPUs never queues (at most
  about 60 GPUs are busy at once: the trace's README), so the cluster is cut down until it does.
  A pod no node could ever hold (more cores or memory than a node) is dropped and counted.
- Projects: pod number i (its row in the file, from 0) belongs to project i mod 3 — "vision",
  "nlp", "speech" — with share weights `--weights` (default 3, 2, 1). Each project sends a third
  of the pods, so each has work waiting whenever the cluster is full.
- Priority and preemption: qos BE → priority 0, every other qos (LS, Burstable, Guaranteed) →
  priority 1. Every pod is a batch session, hence preemptible (the launch's default), with
  `--min-runtime` seconds (default 600) of minimum runtime. A preempted pod is warned, stopped
  `--grace` seconds later (default 300, FGPU_PREEMPTION_GRACE_SECONDS' default) and sent again
  as a new session arriving at its stop, with its whole duration (its work is lost).
- Scheduler: `sessions.scheduling.scheduler.schedule_pending`'s rules on the pure modules: a pass at every
  arrival, end and stop; the queue ordered by priority, then fair-share factor
  (`sessions.scheduling.fairshare.fair_share_factor` over usage decayed by `--half-life-days`, default 7,
  with `sessions.scheduling.fairshare.decayed_seconds`), then arrival; placement by `core.place` under
  `--policy` (default binpack); a request that did not fit is not tried again in the same pass;
  backfill up to FGPU_BACKFILL_LIMIT (8) overtakes; then preemption for the first
  `preemption.MAX_WAITERS_PER_PASS` blocked sessions without victims under notice, by
  `accelerators.allocation.preemption.preemption_choice` (what is stopping already counts as free).

Printed: per project its share of the GPU-time over the run and over the contended time (when all
three projects have sessions waiting) against its weight share, and the largest distance; the
sessions preempted, the GPU-hours they lost, the longest notice-to-stop; waits per priority. Asserted:
no session is preempted before its minimum runtime, none is non-preemptible, and GPU usage never
exceeds capacity. Results: benchmarks/results/fairshare_queue.txt.

Hook: `SECTIONS` lists the report's sections, each `section(replay) -> list[str]` run after the
replay; `Replay.on_arrival` lists observers `observer(replay, session, now)` called as each
session arrives (before the pass), with the replay's state (`replay.nodes`, `.running`,
`.pending`, `.usage`) readable. An ETA-calibration section predicts each arrival's start there
and compares it with `session.started` after the run: append both, nothing else changes.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder is sys.path[0], where "queue" would shadow the standard
# library's (which Django's imports need): the folder goes, the project's root comes.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from accelerators.allocation import core  # noqa: E402
from accelerators.allocation.errors import AllocationError, NeverSchedulable  # noqa: E402
from accelerators.allocation.preemption import SHARE_MARGIN, Holder, place_on, preemption_choice, release  # noqa: E402
from sessions.scheduling.fairshare import decayed_seconds, fair_share_factor  # noqa: E402
from sessions.scheduling.preemption import MAX_WAITERS_PER_PASS  # noqa: E402

TRACE_DIR = Path(os.environ.get("FGPU_OPENB_DIR", "/work/shared/traces/openb"))
MiB = 1 << 20
GPU_MEMORY = 1000 * MiB  # each GPU: 1 fGPU = 1000 MiB and 1000 "SMs", so fGPU reads as milli-GPU / 1000
SETTINGS = core.FractionalSettings(unit_mem=GPU_MEMORY, unit_proc=1000, quantum=Decimal("0.001"))
PROJECTS = ("vision", "nlp", "speech")
BACKFILL_LIMIT = 8
PRIORITY = {"BE": 0}  # every other qos: 1


@dataclass
class Session:
    """One trace pod as a session (a restart after preemption is a new one, `restart_of` set)."""

    sid: str
    project: str
    priority: int
    request: core.ResourceRequest
    duration: float
    arrival: float
    min_runtime: int
    restart_of: str = ""
    started: float | None = None
    ended: float | None = None
    node: str = ""
    grants: tuple = ()
    overtaken: int = 0
    notice_at: float | None = None  # warned (preempt_at - grace)
    stop_at: float | None = None
    preempted: bool = False

    @property
    def gpus(self) -> float:
        """GPUs it holds while running (fGPU; whole devices count 1 each)."""
        return float(sum((g.shares for g in self.grants), Decimal(0)))


@dataclass
class Replay:
    """The replay's state and what it recorded (see the module)."""

    nodes: list[core.NodeState]
    weights: dict[str, int]
    grace: float
    half_life: float
    policy: str
    margin: float = SHARE_MARGIN
    sessions: list[Session] = field(default_factory=list)
    pending: list[Session] = field(default_factory=list)
    running: dict[str, Session] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)  # decayed fGPU-seconds at `usage_at`
    usage_at: float = 0.0
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # Σ GPUs × seconds, whole run
    contended_seconds: dict[str, float] = field(default_factory=dict)  # … while every project waits
    preemptions: list[tuple[Session, float, float]] = field(default_factory=list)  # (victim, notice, ran at notice)
    dropped: int = 0
    passes: int = 0
    on_arrival: list[Callable] = field(default_factory=list)
    capacity: float = 0.0
    peak: float = 0.0


def load(trace: str, nodes: int, min_runtime: int, limit: int | None) -> tuple[list[core.NodeState], list[Session]]:
    """The cut-down cluster and the trace's GPU pods as sessions (see the module)."""
    eight = [r for r in csv.DictReader(open(TRACE_DIR / "openb_node_list_gpu_node.csv")) if r["gpu"] == "8"][:nodes]
    states = [
        core.NodeState(
            r["sn"],
            cpu_total=int(r["cpu_milli"]) // 1000,
            mem_total=int(r["memory_mib"]) * MiB,
            devices=tuple(
                core.DeviceState(f"{r['sn']}/{i}", memory_total=GPU_MEMORY, proc_total=1000, index=i)
                for i in range(int(r["gpu"]))
            ),
        )
        for r in eight
    ]
    sessions = []
    for i, row in enumerate(csv.DictReader(open(TRACE_DIR / f"openb_pod_list_{trace}.csv"))):
        num, milli = int(row["num_gpu"]), int(row["gpu_milli"])
        if num == 0:
            continue
        cpu, mem = math.ceil(int(row["cpu_milli"]) / 1000), int(row["memory_mib"]) * MiB
        if num >= 2:
            request = core.ResourceRequest("device", amount=Decimal(num), cpu=cpu, mem=mem)
        else:
            request = core.ResourceRequest("shares", amount=Decimal(milli) / 1000, cpu=cpu, mem=mem)
        start = float(row["creation_time"])
        sessions.append(
            Session(
                row["name"],
                PROJECTS[i % 3],
                PRIORITY.get(row["qos"], 1),
                request,
                float(row["deletion_time"]) - start,
                start,
                min_runtime,
            )
        )
        if limit and len(sessions) >= limit:
            break
    return states, sessions


def replay(
    nodes: list[core.NodeState],
    sessions: list[Session],
    *,
    weights: dict[str, int],
    grace: float,
    half_life: float,
    policy: str,
    margin: float = SHARE_MARGIN,
) -> Replay:
    """Run the trace to its end (every session ended or dropped)."""
    r = Replay(nodes=list(nodes), weights=weights, grace=grace, half_life=half_life, policy=policy, margin=margin)
    r.capacity = float(sum(len(n.devices) for n in nodes))
    r.usage = {p: 0.0 for p in weights}
    r.gpu_seconds = {p: 0.0 for p in weights}
    r.contended_seconds = {p: 0.0 for p in weights}
    events: list[tuple[float, int, str, Session]] = []
    seq = 0
    for s in sessions:
        heapq.heappush(events, (s.arrival, seq, "arrive", s))
        seq += 1
    now = 0.0
    while events:
        t = events[0][0]
        _advance(r, now, t)
        now = t
        while events and events[0][0] == t:
            _, _, kind, s = heapq.heappop(events)
            if kind == "arrive":
                if not _ever_fits(r, s):
                    r.dropped += 1
                    continue
                r.sessions.append(s)
                for observer in r.on_arrival:
                    observer(r, s, t)
                r.pending.append(s)
            elif kind == "end" and s.ended is None and s.stop_at is None:
                _end(r, s, t)
            elif kind == "stop" and s.ended is None:
                _end(r, s, t)
                again = Session(
                    f"{s.sid}+", s.project, s.priority, s.request, s.duration, t, s.min_runtime, restart_of=s.restart_of or s.sid
                )
                heapq.heappush(events, (t, seq, "arrive", again))
                seq += 1
        for started in _pass(r, t):
            heapq.heappush(events, (t + started.duration, seq, "end", started))
            seq += 1
        for victim in [s for s in r.running.values() if s.stop_at == t + grace and s.notice_at == t]:
            heapq.heappush(events, (victim.stop_at, seq, "stop", victim))
            seq += 1
    return r


def _ever_fits(r: Replay, s: Session) -> bool:
    try:
        core.check_ever_fits(r.nodes, s.request, SETTINGS)
        return True
    except (NeverSchedulable, AllocationError):
        return False


def _advance(r: Replay, before: float, now: float) -> None:
    """Account the time from `before` to `now`: GPU-seconds per project (and while contended),
    and the decayed usage fair share reads (`sessions.scheduling.fairshare`'s formula)."""
    if now <= before:
        return
    dt = now - before
    held = {p: 0.0 for p in r.weights}
    for s in r.running.values():
        held[s.project] += s.gpus
    waiting = {s.project for s in r.pending}
    for p, gpus in held.items():
        r.gpu_seconds[p] += gpus * dt
        if len(waiting) == len(r.weights):
            r.contended_seconds[p] += gpus * dt
    r.peak = max(r.peak, sum(held.values()))
    assert sum(held.values()) <= r.capacity + 1e-9, "GPU usage above capacity"
    if r.half_life > 0:
        decay = 2.0 ** (-(now - r.usage_at) / r.half_life)
        for p in r.usage:
            r.usage[p] = r.usage[p] * decay + held[p] * decayed_seconds(start=r.usage_at, end=now, now=now, half_life=r.half_life)
        r.usage_at = now


def _factors(r: Replay) -> dict[str, float]:
    """Each project's fair-share factor among the active ones (usage or waiting)."""
    if r.half_life <= 0:
        return {p: 1.0 for p in r.weights}
    waiting = {s.project for s in r.pending}
    active = [p for p in r.weights if r.usage[p] > 0 or p in waiting]
    usage_total = sum(r.usage[p] for p in active)
    weight_total = sum(r.weights[p] for p in active) or 1
    return {
        p: fair_share_factor(usage=r.usage[p], usage_total=usage_total, weight=r.weights[p], weight_total=weight_total)
        if p in active
        else 1.0
        for p in r.weights
    }


def _row(r: Replay, node_id: str) -> int:
    return next(i for i, n in enumerate(r.nodes) if n.node_id == node_id)


def _end(r: Replay, s: Session, t: float) -> None:
    row = _row(r, s.node)
    r.nodes[row] = release(r.nodes[row], [_holder(s, {})])
    s.ended = t
    del r.running[s.sid]


def _holder(s: Session, factors: dict[str, float]) -> Holder:
    return Holder(
        s.sid,
        s.node,
        s.grants,
        cpu=s.request.cpu,
        mem=s.request.mem,
        started_at=s.started or 0.0,
        min_runtime=s.min_runtime,
        preemptible=s.stop_at is None,
        priority=s.priority,
        factor=factors.get(s.project, 1.0),
        name=s.sid,
    )


def _pass(r: Replay, t: float) -> list[Session]:
    """One scheduler pass at `t`; returns the sessions it started."""
    r.passes += 1
    factors = _factors(r)
    r.pending.sort(key=lambda s: (-s.priority, -factors[s.project], s.arrival, s.sid))
    started, blocked, no_room = [], [], []
    reserved = None
    options = {"policy": r.policy}
    for s in list(r.pending):
        if reserved is None:
            reserved = next((b for b in blocked if b.overtaken >= BACKFILL_LIMIT), None)
        if reserved is not None:
            break  # nothing behind a reserved session starts
        key = (s.request.kind, s.request.amount, s.request.cpu, s.request.mem)
        if any(_dominates(key, k) for k in no_room):  # the scheduler's "same shape, no room" cache, widened to
            blocked.append(s)  # larger shapes: placements only fill a pass's cluster
            continue
        try:
            placement = core.place(r.nodes, s.request, SETTINGS, **options)
        except AllocationError:
            no_room.append(key)
            blocked.append(s)
            continue
        row = _row(r, placement.node_id)
        r.nodes[row] = core.apply_placement(r.nodes[row], s.request, placement)
        s.started, s.node, s.grants = t, placement.node_id, placement.grants
        r.pending.remove(s)
        r.running[s.sid] = s
        started.append(s)
        for b in blocked:
            b.overtaken += 1
    _preempt(r, t, blocked, factors, options)
    return started


def _dominates(key: tuple, failed: tuple) -> bool:
    """Whether a request `key` (kind, amount, cores, bytes) asks at least what `failed` asked."""
    return key[0] == failed[0] and all(a >= b for a, b in zip(key[1:], failed[1:], strict=True))


def _preempt(r: Replay, t: float, blocked: list[Session], factors: dict[str, float], options: dict) -> None:
    """`sessions.scheduling.preemption.preemption_pass`'s choice step for the replay: victims warned now,
    stopped at t + grace."""
    waiting_for = {s.preempted_for for s in r.running.values() if getattr(s, "preempted_for", None)}
    stopping = [_holder(s, factors) for s in r.running.values() if s.stop_at is not None]
    hopeless: list[tuple] = []  # requests no preemption could place in this pass
    for waiter in blocked[:MAX_WAITERS_PER_PASS]:
        key = (
            waiter.request.kind,
            waiter.request.amount,
            waiter.request.cpu,
            waiter.request.mem,
            waiter.priority,
            factors[waiter.project],
        )
        if waiter.sid in waiting_for or any(k[4:] == key[4:] and _dominates(key[:4], k[:4]) for k in hopeless):
            continue
        nodes = [release(n, stopping) for n in r.nodes]
        if any(place_on(n, waiter.request, SETTINGS, options) for n in nodes):
            continue  # what is stopping already makes room
        holders = [_holder(s, factors) for s in r.running.values() if s.stop_at is None]
        room = preemption_choice(
            nodes,
            holders,
            waiter.request,
            SETTINGS,
            priority=waiter.priority,
            factor=factors[waiter.project],
            now=t,
            options=options,
            margin=r.margin,
        )
        if room is None:
            hopeless.append(key)
        if room is None or not room.victims:
            continue
        for victim in room.victims:
            s = r.running[victim.session_id]
            assert s.stop_at is None, "a session preempted twice"
            assert t - s.started >= s.min_runtime, f"{s.sid} preempted after {t - s.started:.0f} s (< its minimum)"
            s.notice_at, s.stop_at, s.preempted = t, t + r.grace, True
            s.preempted_for = waiter.sid
            r.preemptions.append((s, t, t - s.started))
            stopping.append(_holder(s, factors))


# --- the report ------------------------------------------------------------------------------------


def fair_share_section(r: Replay) -> list[str]:
    weight_total = sum(r.weights.values())
    total, contended = sum(r.gpu_seconds.values()), sum(r.contended_seconds.values())
    lines = [
        "Fair share: each project's share of the GPU-time against its weight share",
        f"  {'project':8} {'weight':>6} {'w-share':>8} {'run':>8} {'contended':>10} {'GPU-hours':>10}",
    ]
    worst_run = worst_contended = 0.0
    for p, w in r.weights.items():
        ws = w / weight_total
        run = r.gpu_seconds[p] / total if total else 0.0
        con = r.contended_seconds[p] / contended if contended else 0.0
        worst_run, worst_contended = max(worst_run, abs(run - ws)), max(worst_contended, abs(con - ws))
        lines.append(f"  {p:8} {w:>6} {ws:>8.3f} {run:>8.3f} {con:>10.3f} {r.gpu_seconds[p] / 3600:>10.1f}")
    lines.append(
        f"  largest |share - weight share|: {worst_run:.3f} over the run, {worst_contended:.3f} over the "
        f"contended time ({contended / 3600:.1f} of {total / 3600:.1f} GPU-hours)"
    )
    return lines


def preemption_section(r: Replay) -> list[str]:
    victims = [v for v, _, _ in r.preemptions]
    lost = sum(v.gpus * ran for v, _, ran in r.preemptions)
    shortest = min((ran for _, _, ran in r.preemptions), default=0.0)
    by_reason = {"priority": 0, "fair share": 0}
    for v in victims:
        waiter = next(s for s in r.sessions if s.sid == v.preempted_for)
        by_reason["priority" if waiter.priority > v.priority else "fair share"] += 1
    assert all(ran >= v.min_runtime for v, _, ran in r.preemptions)
    return [
        "Preemption",
        f"  sessions preempted: {len(victims)} of {len(r.sessions)} started or waiting "
        f"({by_reason['priority']} for a higher priority, {by_reason['fair share']} for fair share)",
        f"  GPU-hours of work lost: {lost / 3600:.1f}; shortest run before the notice: {shortest:.0f} s "
        f"(minimum runtime {victims[0].min_runtime if victims else '-'} s): none before it (asserted)",
        f"  notice to stop: {r.grace:.0f} s each",
    ]


def wait_section(r: Replay) -> list[str]:
    lines = ["Waits (start - arrival, sessions that started)"]
    for priority in sorted({s.priority for s in r.sessions}, reverse=True):
        waits = sorted(s.started - s.arrival for s in r.sessions if s.priority == priority and s.started is not None)
        if waits:
            lines.append(
                f"  priority {priority}: {len(waits)} sessions, p50 {_quantile(waits, 0.5) / 60:.1f} min, "
                f"p90 {_quantile(waits, 0.9) / 60:.1f} min, max {waits[-1] / 3600:.1f} h"
            )
    return lines


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


SECTIONS: list[Callable[[Replay], list[str]]] = [fair_share_section, preemption_section, wait_section]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument("--nodes", type=int, default=2, help="8-GPU nodes of the trace's node list (default 2)")
    parser.add_argument("--weights", default="3,2,1", help="share weights of vision, nlp, speech")
    parser.add_argument("--grace", type=float, default=300.0)
    parser.add_argument("--min-runtime", type=int, default=600)
    parser.add_argument("--half-life-days", type=float, default=7.0)
    parser.add_argument("--policy", default="binpack")
    parser.add_argument(
        "--share-margin",
        type=float,
        default=SHARE_MARGIN,
        help="fair-share preemption's band (accelerators.allocation.preemption.SHARE_MARGIN)",
    )
    parser.add_argument("--limit", type=int, help="only the first N GPU pods (a quick run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    weights = dict(zip(PROJECTS, (int(w) for w in args.weights.split(",")), strict=True))
    nodes, sessions = load(args.trace, args.nodes, args.min_runtime, args.limit)
    began = time.monotonic()
    r = replay(
        nodes,
        sessions,
        weights=weights,
        grace=args.grace,
        half_life=args.half_life_days * 86400,
        policy=args.policy,
        margin=args.share_margin,
    )
    seconds = time.monotonic() - began
    unfinished = [s for s in r.sessions if s.ended is None]
    header = [
        f"openb {args.trace}: {len(sessions)} GPU pods replayed by their creation and deletion times on "
        f"{len(nodes)} nodes ({int(r.capacity)} GPUs), policy {args.policy}, weights "
        f"{', '.join(f'{p} {w}' for p, w in weights.items())}, half-life {args.half_life_days:g} d, "
        f"grace {args.grace:.0f} s, minimum runtime {args.min_runtime} s, fair-share preemption band "
        f"{args.share_margin:g}",
        f"  {len(r.sessions)} sessions (restarts included), {r.dropped} dropped (no node could ever hold them), "
        f"{len(unfinished)} unfinished; peak {r.peak:.2f} of {r.capacity:.0f} GPUs; {r.passes} passes in "
        f"{seconds:.1f} s",
    ]
    out = header + [""]
    for section in SECTIONS:
        out += section(r) + [""]
    if args.json:
        print(
            json.dumps(
                {
                    "lines": out,
                    "gpu_seconds": r.gpu_seconds,
                    "contended_seconds": r.contended_seconds,
                    "preempted": len(r.preemptions),
                }
            )
        )
    else:
        print("\n".join(out).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
