"""The scheduler's queue over time, replayed in memory (issue 17.3, 17.5): when each waiting
session would start if the running ones end when expected. Pure Python, no Django.

One replay is a discrete-event walk: a pass over the queue now, then one after each moment a
session ends (its `end`, epoch seconds), until every queued session started, could never start,
or nothing that holds room has a known end. A pass follows the real pass's rules
(`sessions.scheduling.scheduler.schedule_pending`): the queue in its order, a request shape that found no
room is not tried again in the same pass, and the backfill rule with reservations (`Backfill`,
`reservation`, the one the real pass uses: a session at the limit reserves where it would run
once the sessions there end, from the replay's ends). What "fits" means is the caller's `Room`
— in the console, `sessions.scheduling.placement.placement_decide` on an in-memory view of the cluster,
i.e. `core.place`, the pure placement the real pass runs; in `benchmarks/eta.py`, `core.place` on the openb cluster. A session the
replay starts holds its room for its own `runtime` (seconds; None: no known end).

Sources: the event-driven replay of a queue against expected ends is Slurm's backfill
scheduler's ("expected start time" of pending jobs from the running jobs' time limits,
`squeue --start`); here the ends are predictions, not limits, and the answer is a band
(`eta_band`: the earliest from the optimistic ends, the latest from the pessimistic ones).
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from accelerators.allocation.reservation import Reservation, Reservations

PLACED = "placed"
WAITING = "waiting"
NEVER = "never"

MAX_EVENTS = 5000  # passes a replay makes at most (a moment at which something ends is one pass)
RESERVATIONS_MAX = 16  # backfill reservations a pass makes at most (each reads the sessions on its nodes)
HISTORY_MIN = 3  # runtimes needed before a history is believed (`remaining_band`'s `minimum`)
# Quantiles of a history that bound a prediction: on openb (benchmarks/eta.py, results/eta.txt) the
# start fell in the band of 93 % of the estimates that gave one at 5-95 %, 43 % at 10-90 %.
HISTORY_BAND = (0.05, 0.95)


class Backfill:
    """The pass's backfill rule with reservations (issue 32.1; Slurm's backfill with
    reservations, Kueue's "BestEffortFIFO"): a session that waits does not block the ones
    behind it, but each time one behind it starts its `overtaken` count grows, and once that
    reaches `limit` (0: at once) it reserves the capacity it waits for (`reservations`,
    `reservation.reservation_find`: its node and devices, from when the sessions there are
    expected to end); later sessions start only where they do not delay a reservation
    (`reservation.Reservations.place_around`). Sessions are anything with a mutable integer
    `overtaken` attribute."""

    def __init__(self, limit: int):
        self.limit = limit
        self.blocked: list[Any] = []
        self.reservations = Reservations()
        self._looked: set[int] = set()  # id() of the blocked sessions whose reservation was looked for
        # Whether `due` may find someone it did not return before: a session blocked at the limit
        # already, or counts grown (`placed`). Else it answers at once: a pass calls it after every
        # session, and a scan of every blocked one each time made a pass over 1,000 waiting
        # sessions quadratic (2.2 s of a profiled what-if with 680 waiting).
        self._fresh = False

    def due(self) -> list[Any]:
        """The blocked sessions overtaken as often as the limit allows whose reservation was not
        looked for yet in this pass (each is returned once), in queue order; the first
        RESERVATIONS_MAX of the pass only (the others wait as before, passable, until those
        ahead of them start: Slurm bounds its backfill's work alike, bf_max_job_test)."""
        room = RESERVATIONS_MAX - len(self._looked)
        if not self._fresh or room <= 0:
            return []
        self._fresh = False  # all those due now are returned, or room runs out
        out = [b for b in self.blocked if b.overtaken >= self.limit and id(b) not in self._looked][:room]
        self._looked.update(id(b) for b in out)
        return out

    def block(self, session: Any) -> None:
        """`session` waits in this pass."""
        self.blocked.append(session)
        if session.overtaken >= self.limit:
            self._fresh = True

    def placed(self) -> list[Any]:
        """A session behind the blocked ones started: each blocked one is overtaken once more.
        Returns them (the real pass writes their counts)."""
        for earlier in self.blocked:
            earlier.overtaken += 1
        self._fresh = self._fresh or bool(self.blocked)
        return self.blocked


@dataclass
class Queued:
    """A waiting session as the replay sees it: `key` (its id), `shape` (sessions of one shape
    find room or not together in a pass: the real pass's short-cut), `overtaken` (its backfill
    count now), `runtime` (seconds it holds its room once started; None: no known end), `name`
    (what a reason calls it), `arrives` (epoch seconds it joins the queue; None: it waits
    already — the console's replay knows no future launches; benchmarks/eta.py replays a trace),
    `limit` (seconds it may run at most, its resource group's maximum lifetime; None: no limit:
    it never runs on capacity reserved for another, `reservation`)."""

    key: str
    shape: str
    overtaken: int = 0
    runtime: float | None = None
    name: str = ""
    arrives: float | None = None
    limit: float | None = None


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
    give back what `key` (running, or placed by this replay) holds. A room that cannot say
    where a session would run reserves everything for a session past the backfill limit (the
    old global stop); a `ReservingRoom` reserves where it would run."""

    def place(self, key: str) -> tuple[str, str]: ...

    def release(self, key: str) -> None: ...


@runtime_checkable
class ReservingRoom(Room, Protocol):
    """A Room that knows nodes and devices: `place_around(key, reservations, end)` places `key`
    (a session ending at `end`, epoch seconds; None: no limit) where it delays none of
    `reservations` (`Reservations.place_around`); `reserve(key, ends, now, earlier)` is
    `reservation.reservation_find` for queued `key` (called `name`; `ends`: the end of each session holding
    room; `earlier`: the pass's reservations so far)."""

    def place_around(self, key: str, reservations: Reservations, end: float | None) -> tuple[str, str]: ...

    def reserve(
        self, key: str, *, name: str, ends: dict[str, float | None], now: float, earlier: list[Reservation]
    ) -> Reservation | None: ...


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
    return Replaying(queue, ends=ends, room=room, now=now, backfill_limit=backfill_limit, max_events=max_events).finish()


class Replaying:
    """`replay` made only as far as it is asked (issue 35.2: an ETA of the queue's head needs the
    replay up to the head, not 1,000 placements behind it): `start(key)` replays until queued
    `key` has its `Start` (a start is never revised: a session placed stays placed, one never
    placeable is so at once, and the rest wait until the end), `finish()` to the end. The
    same steps in the same order as a whole replay, so the same answers. Thread-safe: one
    step at a time."""

    def __init__(
        self,
        queue: Iterable[Queued],
        *,
        ends: dict[str, float | None],
        room: Room,
        now: float,
        backfill_limit: int,
        max_events: int = MAX_EVENTS,
    ):
        self.out = Replay()
        self._steps = _steps([replace(q) for q in queue], dict(ends), room, now, backfill_limit, max_events, self.out)
        self._done = False
        self._lock = threading.Lock()

    def start(self, key: str) -> Start | None:
        """Queued `key`'s Start (None: not in the queue), replaying as far as it takes."""
        with self._lock:
            while key not in self.out.starts and not self._done:
                self._done = next(self._steps, True) is True
            return self.out.starts.get(key)

    def finish(self) -> Replay:
        """The whole replay's outcome."""
        with self._lock:
            while not self._done:
                self._done = next(self._steps, True) is True
            return self.out


def _steps(
    items: list[Queued],
    holding: dict[str, float | None],
    room: Room,
    now: float,
    backfill_limit: int,
    max_events: int,
    out: Replay,
) -> Iterator[None]:
    """`replay`'s walk into `out`, one queued session a step (the caller's items and ends are
    copies)."""
    place = {item.key: i for i, item in enumerate(items)}
    future = sorted((q for q in items if q.arrives is not None and q.arrives > now), key=lambda q: (q.arrives, place[q.key]))
    waiting = [q for q in items if q.arrives is None or q.arrives <= now]
    reasons: dict[str, str] = {}
    t = now
    reserving = room if isinstance(room, ReservingRoom) else None  # once: the protocol's check costs ~0.1 ms a call
    while (waiting or future) and out.passes < max_events:
        if waiting:
            out.passes += 1
            waiting = yield from _pass(waiting, t, room, backfill_limit, holding, out, reasons, reserving)
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


def _pass(
    waiting: list[Queued],
    t: float,
    room: Room,
    backfill_limit: int,
    holding: dict[str, Any],
    out: Replay,
    reasons: dict[str, str],
    reserving: ReservingRoom | None,
) -> Generator[None, None, list[Queued]]:
    """One pass at `t` over `waiting` (queue order): the real pass's rules (module docstring).
    Returns those still waiting; records starts in `out` and the placed ones' ends in `holding`;
    a step after each session. `reserving`: `room` where it is a ReservingRoom, else None."""
    backfill = Backfill(backfill_limit)
    no_room: dict[str, str] = {}
    left = []

    def reserve() -> None:  # the sessions now at the backfill limit reserve what they wait for
        for due in backfill.due():
            if reserving is not None:
                held = backfill.reservations.held
                found = reserving.reserve(due.key, name=due.name or due.key, ends=holding, now=t, earlier=held)
            else:
                found = Reservation.everything(due.key, due.name or due.key)
            if found is not None:
                backfill.reservations.add(found)
                if found.held_reason():
                    reasons[due.key] = f"{reasons.get(due.key, '')}; {found.held_reason()}".lstrip("; ")

    for item in waiting:
        yield None
        everywhere = backfill.reservations.everywhere()
        if everywhere is not None:
            reasons[item.key] = everywhere.blocked_reason()
            left.append(item)
            continue
        if item.shape in no_room:
            reasons[item.key] = no_room[item.shape]
            backfill.block(item)
            left.append(item)
            reserve()
            continue
        if reserving is not None:
            end = None if item.limit is None else t + item.limit
            outcome, why = reserving.place_around(item.key, backfill.reservations, end)
        else:
            outcome, why = room.place(item.key)
        if outcome == NEVER:
            out.starts[item.key] = Start(None, NEVER, why)
            continue
        if outcome != PLACED:
            no_room[item.shape] = reasons[item.key] = why
            backfill.block(item)
            left.append(item)
            reserve()
            continue
        out.starts[item.key] = Start(t, PLACED)
        holding[item.key] = None if item.runtime is None else t + item.runtime
        backfill.placed()
        reserve()
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
