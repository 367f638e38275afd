"""The scheduler's queue over time, replayed in memory (issue 17.3, 17.5): when each waiting
session would start if the running ones end when expected. Pure Python, no Django.

One replay is a discrete-event walk: a pass over the queue now, then one after each moment a
session ends (its `end`, epoch seconds), until every queued session started, could never start,
or nothing that holds room has a known end. A pass follows the real pass's rules
(`sessions.scheduler.schedule_pending`): the queue in its order, a request shape that found no
room is not tried again in the same pass, and the backfill rule (`Backfill`, the one the real
pass uses). What "fits" means is the caller's `Room` — in the console, `sessions.placement
.placement_decide` on an in-memory view of the cluster, i.e. `core.place`, the pure placement
the real pass runs; in `benchmarks/eta.py`, `core.place` on the openb cluster. A session the
replay starts holds its room for its own `runtime` (seconds; None: no known end).

Sources: the event-driven replay of a queue against expected ends is Slurm's backfill
scheduler's ("expected start time" of pending jobs from the running jobs' time limits,
`squeue --start`); here the ends are predictions, not limits, and the answer is a band
(`eta_band`: the earliest from the optimistic ends, the latest from the pessimistic ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

PLACED = "placed"
WAITING = "waiting"
NEVER = "never"

MAX_EVENTS = 5000  # passes a replay makes at most (a moment at which something ends is one pass)
HISTORY_MIN = 3  # runtimes needed before a history is believed (`remaining_band`'s `minimum`)
# Quantiles of a history that bound a prediction: on openb (benchmarks/eta.py, results/eta.txt) the
# start fell in the band of 93 % of the estimates that gave one at 5-95 %, 43 % at 10-90 %.
HISTORY_BAND = (0.05, 0.95)


class Backfill:
    """The pass's backfill rule (Slurm's backfill with a bound on how often a job may be
    passed; Kueue's "BestEffortFIFO"): a session that waits does not block the smaller ones
    behind it, but each time one behind it starts its `overtaken` count grows, and once that
    reaches `limit` nothing behind it starts until it has (0: strict first in, first out).
    Sessions are anything with a mutable integer `overtaken` attribute."""

    def __init__(self, limit: int):
        self.limit = limit
        self.blocked: list = []
        self._reserved = None
        self._looked = (0, 0)  # (blocked, placed) when the reservation was last looked for
        self._placed = 0

    def holder(self):
        """The first blocked session overtaken as often as the limit allows (nothing behind it
        may start in this pass), or None."""
        if self._reserved is None and self._looked != (len(self.blocked), self._placed):  # only a change can make one
            self._looked = (len(self.blocked), self._placed)
            self._reserved = next((b for b in self.blocked if b.overtaken >= self.limit), None)
        return self._reserved

    def block(self, session) -> None:
        """`session` waits in this pass."""
        self.blocked.append(session)

    def placed(self) -> list:
        """A session behind the blocked ones started: each blocked one is overtaken once more.
        Returns them (the real pass writes their counts)."""
        self._placed += 1
        for earlier in self.blocked:
            earlier.overtaken += 1
        return self.blocked


@dataclass
class Queued:
    """A waiting session as the replay sees it: `key` (its id), `shape` (sessions of one shape
    find room or not together in a pass: the real pass's short-cut), `overtaken` (its backfill
    count now), `runtime` (seconds it holds its room once started; None: no known end), `name`
    (what a reason calls it), `arrives` (epoch seconds it joins the queue; None: it waits
    already — the console's replay knows no future launches; benchmarks/eta.py replays a trace)."""

    key: str
    shape: str
    overtaken: int = 0
    runtime: float | None = None
    name: str = ""
    arrives: float | None = None


@dataclass
class Start:
    """What the replay gives one queued session: `at` (epoch seconds) when it starts, or None;
    `outcome` PLACED, WAITING (still waiting when the replay ran out of ends) or NEVER; `reason`
    the last reason it waited (or why never)."""

    at: float | None
    outcome: str
    reason: str = ""


class Room(Protocol):
    """The cluster as a replay changes it. `place(key)`: (PLACED, "") after taking the room for
    queued session `key`, (WAITING, why) or (NEVER, why) leaving it as it was; `release(key)`:
    give back what `key` (running, or placed by this replay) holds."""

    def place(self, key: str) -> tuple[str, str]: ...

    def release(self, key: str) -> None: ...


@dataclass
class Replay:
    """One replay's outcome: `starts` per queued key, `passes` made, `ended` (key → end time)
    of what ended during it."""

    starts: dict[str, Start] = field(default_factory=dict)
    passes: int = 0
    ended: dict[str, float] = field(default_factory=dict)


def replay(
    queue: Iterable[Queued],
    *,
    ends: dict[str, float | None],
    room: Room,
    now: float,
    backfill_limit: int,
    max_events: int = MAX_EVENTS,
) -> Replay:
    """Replay `queue` (in queue order; not changed) on `room` from `now` (epoch seconds).
    `ends`: key of each session holding room now → when it ends (epoch seconds; None: no known
    end: it holds its room for the whole replay). A queued session with `arrives` joins the
    queue then, in its place in `queue`'s order. Returns every queued key's `Start`."""
    items = [Queued(q.key, q.shape, q.overtaken, q.runtime, q.name, q.arrives) for q in queue]  # the caller's stay
    place = {item.key: i for i, item in enumerate(items)}
    future = sorted((q for q in items if q.arrives is not None and q.arrives > now), key=lambda q: (q.arrives, place[q.key]))
    waiting = [q for q in items if q.arrives is None or q.arrives <= now]
    holding = dict(ends)
    out = Replay()
    reasons: dict[str, str] = {}
    t = now
    while (waiting or future) and out.passes < max_events:
        if waiting:
            out.passes += 1
            waiting = _pass(waiting, t, room, backfill_limit, holding, out, reasons)
        upcoming = [end for end in holding.values() if end is not None] + [q.arrives for q in future[:1] if q.arrives is not None]
        if not upcoming or (not waiting and not future):
            break
        t = max(t, min(upcoming))
        for key, end in [(k, end) for k, end in holding.items() if end is not None and end <= t]:
            room.release(key)
            del holding[key]
            out.ended[key] = end
        joined = False
        while future and future[0].arrives is not None and future[0].arrives <= t:  # (arrives: set on every future item)
            waiting.append(future.pop(0))
            joined = True
        if joined:
            waiting.sort(key=lambda q: place[q.key])
    for item in waiting + future:
        out.starts[item.key] = Start(None, WAITING, reasons.get(item.key, ""))
    return out


def _pass(
    waiting: list[Queued], t: float, room: Room, backfill_limit: int, holding: dict, out: Replay, reasons: dict[str, str]
) -> list[Queued]:
    """One pass at `t` over `waiting` (queue order): the real pass's rules (module docstring).
    Returns those still waiting; records starts in `out` and the placed ones' ends in `holding`."""
    backfill = Backfill(backfill_limit)
    no_room: dict[str, str] = {}
    left = []
    for item in waiting:
        holder = backfill.holder()
        if holder is not None:
            reasons[item.key] = f"queued behind {holder.name or holder.key}, which goes first (backfill limit)"
            left.append(item)
            continue
        if item.shape in no_room:
            reasons[item.key] = no_room[item.shape]
            backfill.block(item)
            left.append(item)
            continue
        outcome, why = room.place(item.key)
        if outcome == NEVER:
            out.starts[item.key] = Start(None, NEVER, why)
            continue
        if outcome != PLACED:
            no_room[item.shape] = reasons[item.key] = why
            backfill.block(item)
            left.append(item)
            continue
        out.starts[item.key] = Start(t, PLACED)
        backfill.placed()
        holding[item.key] = None if item.runtime is None else t + item.runtime
    return left


@dataclass(frozen=True)
class Band:
    """An ETA: `earliest` and `latest` start (epoch seconds; `latest` None: unknown), or
    neither with `outcome` NEVER / WAITING (unknown) and `reason`."""

    earliest: float | None
    latest: float | None
    outcome: str
    reason: str = ""


def eta_band(early: Start, late: Start) -> Band:
    """One session's band from its start in the optimistic replay (running sessions end at
    their earliest expected end) and in the pessimistic one (at their latest; unknown ends
    never). NEVER wins; a session that starts in neither replay is WAITING (unknown) with the
    optimistic replay's reason; one that starts only in the optimistic one has no `latest`."""
    if NEVER in (early.outcome, late.outcome):
        return Band(None, None, NEVER, early.reason if early.outcome == NEVER else late.reason)
    if early.at is None and late.at is None:
        return Band(None, None, WAITING, early.reason or late.reason)
    if early.at is None or late.at is None:
        at = early.at if early.at is not None else late.at
        return Band(at, None, PLACED, late.reason or early.reason)
    return Band(min(early.at, late.at), max(early.at, late.at), PLACED)


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile (0–1) of `values` (not empty), by linear interpolation between the
    sorted values (NumPy's default, "linear")."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def remaining_band(history: list[float], elapsed: float, *, low: float, high: float, minimum: int) -> tuple[float, float] | None:
    """How much longer a session that has run `elapsed` seconds runs, from the runtimes
    (seconds) of like sessions before it: the `low` and `high` quantiles of those that ran at
    least as long, minus `elapsed` (never below 0). None with fewer than `minimum` such runtimes
    (no history to go by)."""
    longer = [r for r in history if r >= elapsed]
    if len(longer) < minimum:
        return None
    return max(0.0, quantile(longer, low) - elapsed), max(0.0, quantile(longer, high) - elapsed)
