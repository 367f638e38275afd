"""What must go for a request to fit: the fewest sessions whose removal lets the real allocator
place it on one node, and the preemption rule built on it (issue 17.2). Pure Python, no Django.

Terms: a *holder* is a session holding resources on a node (`Holder`: its grants, CPU cores and
memory bytes, when it started, its minimum runtime, whether it is preemptible, its priority and
its owner's fair-share factor). `room_needed` answers "which of these holders, removed, make
`request` fit?" for any rule of which holders may go (`eligible`) and in which order they are
preferred (`order`); `preemption_choice` is that question under the preemption rule:

- only preemptible holders, and only once they ran their minimum runtime;
- only for a waiting request of higher priority (Slurm's PreemptType=preempt/qos), or of the
  same priority whose owner is under its fair share while the holder's owner is over theirs,
  each by SHARE_MARGIN (a tenth of the share: factors ≥ 0.536 and ≤ 0.467, `sessions.scheduling.fairshare`):
  KAI's reclaim takes back only from queues above their fair share, for queues below theirs;
  Kueue's fair-sharing preemption likewise never takes from a queue whose share is not above
  the preemptor's. The band keeps accounts that hover at their shares from preempting each
  other in turn as their usage crosses (benchmarks/fairshare_queue.py measured the churn without it);
- never a holder of higher priority than the waiting request (`may_preempt`); among the sets
  that make it fit, all on one node (a session is placed on one node): the lowest priority
  first (the set whose highest-priority member is lowest: no session of priority p goes while
  sessions of lower priorities alone would do; Kueue's and Slurm's preemption take the lowest
  priority first), then the least work lost (fGPU-hours: each victim's fGPU × the hours it ran;
  a restarted job loses what it ran), then the fewest sessions, then the youngest (the most
  recently started, as Kueue and KAI prefer);
- the fit is checked with the allocator itself (`core.place` on the node with the holders
  released, under the resource group's placement options), so nothing is preempted to make room
  the request could not use (a device split, a NUMA or topology rule, CPU or memory).

The ETA and what-if engineers reuse `room_needed` with their own `eligible` (every running
session) and `order` (the declared or predicted end) for "what would make it fit now".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any
from dataclasses import dataclass, field, replace
from decimal import Decimal
from itertools import combinations

from accelerators.allocation import core
from accelerators.allocation.errors import InsufficientResource, NeverSchedulable

UNDER_SHARE = 0.5  # a fair-share factor above this: the account used less than its share (sessions.scheduling.fairshare)
# Fair-share preemption needs the waiting account at most (1 - SHARE_MARGIN) of its share used and the
# holder's at least (1 + SHARE_MARGIN): factor ≥ 2^-(1 - m) and ≤ 2^-(1 + m). Without the band, accounts that
# hover at their shares under contention preempted each other at every crossing (benchmarks/fairshare_queue.py).
SHARE_MARGIN = 0.1
MAX_SUBSETS = 4096  # subsets the allocator is asked about per node; past it an irreducible set is taken (room_needed)
MAX_ENUMERATED = 200_000  # subsets looked at per node (most are ruled out by what they free without the allocator)
MAX_COSTED = 20_000  # sets whose cost a cheapest-set search (room_needed's `cost`) computes per node; then the best found


@dataclass(frozen=True)
class Holder:
    """A session holding resources on node `node_id`: `grants` (the allocator's DeviceGrant,
    device ids as in the node's DeviceState), `cpu` cores, `mem` bytes; `started_at` (epoch
    seconds it started running), `min_runtime` (seconds it may not be preempted before),
    `preemptible`, `priority`, `factor` (its owner's fair-share factor, 0–1], `name` for
    messages, and `request` (what it asked for: what it asks again when a compaction plan
    moves it; None: its grants' fGPU)."""

    session_id: str
    node_id: str
    grants: tuple[core.DeviceGrant, ...] = ()
    cpu: int = 0
    mem: int = 0
    started_at: float = 0.0
    min_runtime: int = 0
    preemptible: bool = False
    priority: int = 0
    factor: float = 1.0
    name: str = ""
    request: core.ResourceRequest | None = field(default=None, compare=False)

    @property
    def shares(self) -> Decimal:
        """The fGPU it holds (the sum of its grants' shares)."""
        return sum((g.shares for g in self.grants), core.ZERO)

    def ran(self, now: float) -> float:
        """Seconds it has run at `now` (epoch seconds)."""
        return max(0.0, now - self.started_at)


@dataclass(frozen=True)
class Room:
    """What makes a request fit: remove `victims` (holders, all on `node_id`; empty when it fits
    as things are) and the allocator places it as `placement`."""

    node_id: str
    victims: tuple[Holder, ...] = ()
    placement: core.Placement | None = field(default=None, compare=False)

    def cost(self, now: float) -> tuple[int, float]:
        """(sessions removed, fGPU-seconds of their work lost at `now`: each victim's fGPU × the
        seconds it has run)."""
        return len(self.victims), sum(float(v.shares) * v.ran(now) for v in self.victims)


def release(node: core.NodeState, holders: Iterable[Holder]) -> core.NodeState:
    """`node` with `holders`' grants, cores and memory given back (the inverse of
    `core.apply_placement`). Holders on other nodes are ignored. Never below zero."""
    taken: dict[str, list[core.DeviceGrant]] = {}
    cpu = mem = 0
    for h in holders:
        if h.node_id != node.node_id:
            continue
        cpu, mem = cpu + h.cpu, mem + h.mem
        for g in h.grants:
            taken.setdefault(g.device_id, []).append(g)
    devices = []
    for d in node.devices:
        for g in taken.get(d.device_id, ()):
            d = replace(
                d,
                memory_used=max(0, d.memory_used - g.memory),
                proc_used=max(core.ZERO, d.proc_used - g.procs),
                sessions=max(0, d.sessions - 1),
            )
        devices.append(d)
    return replace(node, cpu_used=max(0, node.cpu_used - cpu), mem_used=max(0, node.mem_used - mem), devices=tuple(devices))


def place_on(
    node: core.NodeState,
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: dict[str, Any] | None = None,
) -> core.Placement | None:
    """The allocator's plan for `request` on `node` alone under `options` (`core.place`'s
    policy, strategy, no_fragmentation), or None when it does not fit there now or ever."""
    try:
        return core.place([node], request, settings, **(options or {}))
    except (InsufficientResource, NeverSchedulable):
        return None


def room_needed(
    nodes: Sequence[core.NodeState],
    holders: Iterable[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    *,
    eligible: Callable[[Holder], bool] = lambda h: True,
    order: Callable[[Holder], Any] = lambda h: 0,
    options: dict[str, Any] | None = None,
    accept: Callable[[Room], bool] | None = None,
    cost: Callable[[Sequence[Holder]], Any] | None = None,
) -> Room | None:
    """The fewest `eligible` holders, all on one node, whose removal lets the allocator place
    `request` there (`core.place` under `options`); among sets of that size the one first by
    `order` (the sorted order keys compared in turn); among nodes, the fewest victims, then
    `order`, then the nodes' order. `cost` (None: as just said): a set's cost instead, which
    never falls when a holder is added (e.g. the work it loses): the set of least cost among all
    that fit, on the node of least cost (then the nodes' order). `accept` (None: any): a further
    test a candidate Room must pass (the compaction plan's "the moved sessions fit elsewhere").
    A request that fits as things are gets a Room without victims. None when no node can be made
    to hold it with its eligible holders removed.

    `nodes`: NodeState as the scheduler reads them (each holder's grants included in its
    node's usage); `holders`: the sessions holding them (those on other nodes are ignored).
    Subsets that free too little CPU, memory or fGPU to cover what the node lacks are ruled out
    without asking the allocator. Exact while a node needs at most MAX_SUBSETS allocator calls
    (and MAX_ENUMERATED subsets looked at); past that, every eligible holder removed and then each
    one the fit does not need put back (no member can be spared, though a smaller set may exist).
    Raises nothing of its own."""
    by_node: dict[str, list[Holder]] = {}
    for h in holders:
        if eligible(h):
            by_node.setdefault(h.node_id, []).append(h)
    best: tuple[Any, ...] | None = None
    for position, node in enumerate(nodes):
        mine, check = sorted(by_node.get(node.node_id, []), key=order), accept or (lambda room: True)
        if cost is not None:  # only a set cheaper than the best node's can win
            found = _cheapest_room(node, mine, request, settings, options, check, cost, best[0][0] if best else None)
        else:
            found = _node_room(node, mine, request, settings, options, check)
        if found is None:
            continue
        if cost is not None:
            key: tuple[Any, ...] = (cost(found.victims), position)
        else:
            key = (len(found.victims), [order(v) for v in found.victims], position)
        if best is None or key < best[0]:
            best = (key, found)
        if not found.victims:
            break  # fits as it is: nothing can beat that
    return best[1] if best is not None else None


def _as_is_or_shortfall(
    node: core.NodeState,
    candidates: list[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: dict[str, Any] | None,
    accept: Callable[[Room], bool],
) -> Room | tuple[tuple[int, int, Decimal], dict[str, Decimal]] | None:
    """A Room without victims where `request` fits `node` as it is; None where it would not fit
    with every candidate removed; else what the node lacks (`_shortfall`) and what each
    candidate frees (`_freed`, by session id), for the search."""
    placement = place_on(node, request, settings, options)
    if placement is not None and accept(Room(node.node_id, (), placement)):
        return Room(node.node_id, (), placement)
    if not candidates or place_on(release(node, candidates), request, settings, options) is None:
        return None
    return _shortfall(node, request, settings), {h.session_id: _freed(h, settings) for h in candidates}


def _node_room(
    node: core.NodeState,
    candidates: list[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: dict[str, Any] | None,
    accept: Callable[[Room], bool],
) -> Room | None:
    """`room_needed` on one node; `candidates` in preference order."""
    found = _as_is_or_shortfall(node, candidates, request, settings, options, accept)
    if found is None or isinstance(found, Room):
        return found
    short, freed = found
    tried = enumerated = 0
    for size in range(1, len(candidates) + 1):
        for subset in combinations(candidates, size):  # in preference order: the first that fits wins
            enumerated += 1
            if not _covers(subset, short, freed):
                continue  # frees too little CPU, memory or fGPU: the allocator need not be asked
            tried += 1
            if tried > MAX_SUBSETS or enumerated > MAX_ENUMERATED:
                room = _irreducible(node, candidates, request, settings, options)
                return room if accept(room) else None
            placement = place_on(release(node, subset), request, settings, options)
            if placement is not None and accept(Room(node.node_id, subset, placement)):
                return Room(node.node_id, subset, placement)
    return None  # every candidate set that fits was refused by `accept`


def _cheapest_room(
    node: core.NodeState,
    candidates: list[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: dict[str, Any] | None,
    accept: Callable[[Room], bool],
    cost: Callable[[Sequence[Holder]], Any],
    bound: Any = None,
) -> Room | None:
    """`room_needed` on one node under a set `cost` (monotone: adding a holder never lowers it):
    the set of least cost that fits, if it costs less than `bound` (None: any). Branch and bound
    over `candidates` in preference order (the cheapest first, so a good set is found early): a
    set that fits is not grown, and a set that costs `bound` or the best found so far is not
    grown either (nothing it grows into costs less), nor one that could not free enough even with
    every later candidate. Within MAX_SUBSETS allocator calls and MAX_COSTED sets priced; past
    them, the best found (else `_irreducible`'s)."""
    found = _as_is_or_shortfall(node, candidates, request, settings, options, accept)
    if found is None or isinstance(found, Room):
        return found
    short, freed = found
    best: list[Any] = [bound, None]  # [cost to beat, Room]
    counts = [0, 0]  # [allocator calls, sets looked at]
    # What the candidates from j on free at most, together: a set that cannot cover the shortfall
    # even with all of them is not grown. Sums carried along (cores, bytes, fGPU), not recounted.
    rest = [(0, 0, core.ZERO)] * (len(candidates) + 1)
    for j in range(len(candidates) - 1, -1, -1):
        h, (cpu, mem, fgpu) = candidates[j], rest[j + 1]
        rest[j] = (cpu + h.cpu, mem + h.mem, fgpu + freed[h.session_id])

    def covers(total: tuple[Any, ...], extra: tuple[Any, ...] = (0, 0, core.ZERO)) -> bool:
        return (
            total[0] + extra[0] >= short[0]
            and total[1] + extra[1] >= short[1]
            and (not short[2] or total[2] + extra[2] >= short[2])
        )

    def grow(start: int, chosen: tuple[Holder, ...], total: tuple[Any, ...]) -> bool:
        """Extend `chosen` (freeing `total`) with candidates from `start` on; False once a bound is reached."""
        for j in range(start, len(candidates)):
            h = candidates[j]
            subset, now_total = (*chosen, h), (total[0] + h.cpu, total[1] + h.mem, total[2] + freed[h.session_id])
            if not covers(now_total, rest[j + 1]):
                break  # nor with any later candidate in its place (they free less together)
            counts[1] += 1
            if counts[1] > MAX_COSTED:
                return False
            price = cost(subset)
            if best[0] is not None and not price < best[0]:
                continue  # neither it nor what it grows into can beat the set found
            if covers(now_total):
                counts[0] += 1
                if counts[0] > MAX_SUBSETS:
                    return False
                placement = place_on(release(node, subset), request, settings, options)
                if placement is not None and accept(Room(node.node_id, subset, placement)):
                    best[:] = [price, Room(node.node_id, subset, placement)]
                    continue  # it fits: growing it only costs more
            if not grow(j + 1, subset, now_total):
                return False
        return True

    if not grow(0, (), (0, 0, core.ZERO)) and best[1] is None:
        room = _irreducible(node, candidates, request, settings, options)
        return room if accept(room) and (bound is None or cost(room.victims) < bound) else None
    cheapest: Room | None = best[1]
    return cheapest


def _shortfall(
    node: core.NodeState, request: core.ResourceRequest, settings: core.FractionalSettings | None
) -> tuple[int, int, Decimal]:
    """What `node` lacks for `request` at the least, whatever the allocator's choice: (CPU
    cores, memory bytes, fGPU; fGPU only for an fGPU request), each ≥ 0. The fGPU free is
    counted before truncation and split counts (what removing sessions could at most add to)."""
    cpu = max(0, request.cpu - (node.cpu_total - node.cpu_used))
    mem = max(0, request.mem - (node.mem_total - node.mem_used))
    fgpu = core.ZERO
    if request.kind == "shares" and settings is not None:
        free = sum(
            (
                max(
                    core.ZERO,
                    min(
                        Decimal(d.memory_total - d.memory_used) / settings.unit_mem,
                        (Decimal(d.proc_total) - d.proc_used) / settings.unit_proc,
                    ),
                )
                for d in node.devices
            ),
            core.ZERO,
        )
        fgpu = max(core.ZERO, request.amount - free)
    return cpu, mem, fgpu


def _freed(holder: Holder, settings: core.FractionalSettings | None) -> Decimal:
    """The most fGPU removing `holder` can add to its node's free count (`_shortfall`'s)."""
    if settings is None:
        return core.ZERO
    return sum((max(Decimal(g.memory) / settings.unit_mem, g.procs / settings.unit_proc) for g in holder.grants), core.ZERO)


def _covers(subset: Sequence[Holder], short: tuple[int, int, Decimal], freed: dict[str, Decimal]) -> bool:
    """Whether removing `subset` frees at least `short` (a necessary condition only)."""
    cpu, mem, fgpu = short
    return (
        sum(h.cpu for h in subset) >= cpu
        and sum(h.mem for h in subset) >= mem
        and (not fgpu or sum((freed[h.session_id] for h in subset), core.ZERO) >= fgpu)
    )


def _irreducible(
    node: core.NodeState,
    candidates: list[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: dict[str, Any] | None,
) -> Room:
    """Every candidate removed, then each put back, least preferred first, where the request
    still fits without it."""
    chosen = list(candidates)
    for h in reversed(candidates):
        rest = [c for c in chosen if c is not h]
        if place_on(release(node, rest), request, settings, options) is not None:
            chosen = rest
    return Room(node.node_id, tuple(chosen), place_on(release(node, chosen), request, settings, options))


def may_preempt(holder: Holder, *, priority: int, factor: float, now: float, margin: float = SHARE_MARGIN) -> bool:
    """Whether a waiting request of `priority` whose owner has fair-share `factor` may preempt
    `holder` at `now` (epoch seconds): the holder is preemptible and ran its minimum runtime, and
    the waiting request has a higher priority, or the same priority with its owner under its
    share by `margin` (at most 1 - margin of it used: factor ≥ 2^-(1 - margin)) and the holder's
    owner over theirs by as much (factor ≤ 2^-(1 + margin); see the module)."""
    if not holder.preemptible or holder.ran(now) < holder.min_runtime:
        return False
    if priority != holder.priority:
        return priority > holder.priority
    return bool(factor >= 2.0 ** -(1 - margin) and holder.factor <= 2.0 ** -(1 + margin))


def work_lost(holder: Holder, now: float) -> float:
    """The work `holder` loses if stopped at `now` (epoch seconds): fGPU-hours, its fGPU × the
    hours it has run."""
    return float(holder.shares) * holder.ran(now) / 3600


def victims_cost(victims: Sequence[Holder], now: float, works: dict[str, float] | None = None) -> tuple[Any, ...]:
    """How much preempting `victims` (one node's) costs at `now`, compared as a tuple: per
    priority among them, the highest first, (priority, fGPU-hours of work lost at it
    (`work_lost`, to the microhour), how many) — so a set that touches a higher priority costs
    more than any that does not, and at the same priorities the one that loses less work there
    costs less — then the youngest first (their start times, latest first, negated), then their
    ids (a stable choice). Never falls when a victim is added. `works`: `work_lost` by session id,
    where the caller has it (the search asks for many sets of the same holders)."""
    levels: dict[int, list[float]] = {}
    for v in victims:
        levels.setdefault(v.priority, []).append(works[v.session_id] if works is not None else work_lost(v, now))
    return (
        [(p, round(sum(levels[p]), 6), len(levels[p])) for p in sorted(levels, reverse=True)],
        sorted(-v.started_at for v in victims),
        sorted(v.session_id for v in victims),
    )


def preemption_choice(
    nodes: Sequence[core.NodeState],
    holders: Iterable[Holder],
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    *,
    priority: int,
    factor: float,
    now: float,
    options: dict[str, Any] | None = None,
    margin: float = SHARE_MARGIN,
) -> Room | None:
    """The sessions to preempt for a waiting `request` (of `priority`, its owner's fair-share
    `factor`) at `now` (epoch seconds), among the holders `may_preempt` allows (never one of
    higher priority than `priority`): the lowest priority first — the sets of holders of the
    lowest priority alone are tried first, a higher priority only where they cannot make room
    on any node — then, among the sets that fit at that priority (on any node), the least
    `victims_cost`: at each priority, highest first, the least work lost in fGPU-hours, then
    the fewest; then the youngest. None when
    preemption cannot make it fit (then nothing is preempted); a Room without victims when it
    fits already. Shapes as `room_needed`."""
    allowed = [h for h in holders if may_preempt(h, priority=priority, factor=factor, now=now, margin=margin)]
    works = {h.session_id: work_lost(h, now) for h in allowed}
    levels: list[int | None] = [*sorted({h.priority for h in allowed})] or [None]
    for level in levels:
        room = room_needed(
            nodes,
            [h for h in allowed if level is None or h.priority <= level],
            request,
            settings,
            order=lambda h: (h.priority, works[h.session_id], -h.started_at, h.session_id),
            options=options,
            cost=lambda victims: victims_cost(victims, now, works),
        )
        if room is not None:
            return room
    return None
