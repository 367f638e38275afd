"""Backfill reservations (issue 32.1): which capacity a waiting session holds once it has been
overtaken as often as the backfill limit allows, and whether a later session's placement would
delay it. Pure Python, no Django: the scheduler's pass (`sessions.scheduling.scheduler`) and the ETA's
replay (`accelerators.allocation.replay`) apply the same rule.

Source: Slurm's backfill scheduler (sched/backfill): the first pending job that cannot start
gets a reservation at the earliest time the running jobs' ends make room for it, on the
resources it would get then; a later job starts now only where it does not delay that
reservation: on other resources freely, on the reserved ones only when its time limit ends it
before the reservation's start. Kueue's BestEffortFIFO is the same "smaller ones go ahead
unless they delay the head" rule without the times. Here the reservation is on one node: the
devices the allocator would grant at that time (pins, exclusions, image, group: the caller's
nodes and placement), and the node's CPU cores and memory beyond what the reserving session
needs stay free for others. A session with no runtime limit (None) never runs on reserved
capacity; a reservation with no known time (the sessions it waits for have no declared end)
holds its devices until it starts.

Limits: a fractional reservation holds its whole devices; a MIG request reserves no GPU
instance (they are planned by `mig` when room comes) but holds back later MIG requests
(`Reservation.mig`), and MIG placements are not weighed against a reservation's CPU cores and
memory; a pass reserves for at most `replay.RESERVATIONS_MAX` sessions; a room that cannot say
where a session would run (`Reservation.everything`) holds everything, which is the old global
stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Protocol

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError, InsufficientResource, NeverSchedulable

EVERYWHERE = "<all>"  # a reservation's node_id when it holds every node (`Reservation.everything`)
MIG_GPUS = "<mig>"  # a reservation's node_id when it holds the MIG GPUs (`Reservation.mig`)


def clock(at: float | None) -> str:
    """How a reason names a time: "~12:03 UTC" (epoch seconds), "when the sessions there end
    (no known end)" for None."""
    if at is None:
        return "once the sessions there end (no known end)"
    return "from ~" + datetime.fromtimestamp(at, tz=timezone.utc).strftime("%H:%M") + " UTC"


def device_names(devices: Iterable[core.DeviceState]) -> str:
    """How a reason names devices: "GPU 0-1", "GPU 0,2", "GPU <uuid>"; "CPU and memory" for none."""
    devices = list(devices)
    if not devices:
        return "CPU and memory"
    indexes = sorted(d.index for d in devices if d.index is not None)
    if len(indexes) != len(devices):
        return "GPU " + ",".join(sorted(d.uuid or d.device_id for d in devices))
    runs: list[list[int]] = []
    for i in indexes:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "GPU " + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


EARLIER = "an earlier session in the queue"  # who a reservation is for, in another session's reason


@dataclass(frozen=True)
class Reservation:
    """Capacity held for waiting session `key` (called `name` in reasons): `devices` (device
    ids, named `labels`) on node `node_id` (EVERYWHERE: every node), from `at` (epoch seconds;
    None: no known time, held until it starts); of the node's CPU cores and memory (bytes),
    `cpu_spare` and `mem_spare` are left for sessions still running at `at`. `waits_for`: how
    many running sessions' ends it waits for."""

    key: str
    name: str
    node_id: str
    devices: frozenset[str] = frozenset()
    labels: str = ""
    at: float | None = None
    cpu_spare: int = 0
    mem_spare: int = 0
    waits_for: int = 0

    @classmethod
    def everything(cls, key: str, name: str) -> Reservation:
        """A reservation of every node (a room that cannot say where `key` would run)."""
        return cls(key, name, EVERYWHERE)

    @classmethod
    def mig(cls, key: str, name: str) -> Reservation:
        """A MIG request's reservation: no later MIG request starts before it (its GPU
        instance is planned by `mig` when room comes, not reserved here); shared slices go on."""
        return cls(key, name, MIG_GPUS)

    def held_reason(self) -> str:
        """The reserving session's own words: "reserved GPU 0-1 on node-a for it from ~12:03 UTC"."""
        if self.node_id == EVERYWHERE:
            return ""  # its reason stays what it waits for (the old global stop's)
        if self.node_id == MIG_GPUS:
            return "no later MIG request starts until it has (backfill limit)"
        return f"reserved {self.labels} on {self.node_id} for it {clock(self.at)}"

    def blocked_reason(self) -> str:
        """What a session kept off this reservation reads: "GPU 0-1 on node-a reserved from ~12:03
        UTC for an earlier session (backfill limit)". It names no session: the reserving one may
        be another user's (issue 32.3: reasons name no other user's session)."""
        if self.node_id == EVERYWHERE:
            return f"queued behind {EARLIER}, which goes first (backfill limit)"
        if self.node_id == MIG_GPUS:
            return f"queued behind {EARLIER}, which goes first on the MIG GPUs (backfill limit)"
        return (
            f"{self.labels} on {self.node_id} reserved {clock(self.at)} for {EARLIER}, which has been passed "
            f"as often as the backfill limit allows (it would not end before then)"
        )


class Held(Protocol):
    """What a running (or already placed) session holds: `node_id`, `cpu` cores, `mem` bytes,
    `grants`."""

    @property
    def node_id(self) -> str: ...

    @property
    def cpu(self) -> int: ...

    @property
    def mem(self) -> int: ...

    @property
    def grants(self) -> tuple[core.DeviceGrant, ...]: ...


@dataclass(frozen=True)
class Holding:
    """A `Held` of the caller's making: what one session holds on node `node_id`."""

    node_id: str
    cpu: int
    mem: int
    grants: tuple[core.DeviceGrant, ...]


def _blank(device: core.DeviceState) -> core.DeviceState:
    """`device` shown full: no allocator grants anything of it."""
    return replace(
        device,
        memory_used=device.memory_total,
        proc_used=Decimal(device.proc_total),
        sessions=max(device.sessions, device.max_sessions),
    )


def _may_fit(node: core.NodeState, request: core.ResourceRequest, settings: core.FractionalSettings | None) -> bool:
    """A cheap necessary condition for `request` on `node` (free CPU cores and memory; idle
    devices for whole ones, devices not full for per-device requests, free fGPU for shares):
    False only where `core.place` would refuse it, so a reservation skips its cost there."""
    if node.cpu_total - node.cpu_used < request.cpu or node.mem_total - node.mem_used < request.mem:
        return False
    if request.kind == "device":
        return sum(1 for d in node.devices if d.is_idle) >= request.amount
    if request.kind == "per_device":
        return sum(1 for d in node.devices if not d.is_full) >= request.amount
    if request.kind == "shares" and settings is not None:
        return sum((core.device_free_shares(d, settings) for d in node.devices), Decimal(0)) >= request.amount
    return True


def reservation_find(
    nodes: Sequence[core.NodeState],
    *,
    key: str,
    name: str,
    request: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    options: Mapping[str, Any],
    holdings: Mapping[str, Held],
    ends: Mapping[str, float | None],
    now: float,
    earlier: Sequence[Reservation] = (),
) -> Reservation | None:
    """Where and from when waiting session `key` (its `request`, the slot's `settings`, placed
    under its group's placement `options`, `core.place`'s keywords) reserves: the sessions
    holding room on `nodes` (`holdings`, key → what it holds; others ignored) end in the order
    of their `ends` (epoch seconds; None: no known end, last) until `core.place` places it; the
    reservation is that placement's node and devices, from the last of those ends (`now` if
    none had to end; None if one has no known end). Devices an `earlier` reservation holds
    are not planned on while another way exists; if none does, the reservation overlaps them
    with no known time (it starts after that one). None when it would not fit even with every
    session there ended (it waits for something else: an image, a LOST node)."""
    taken = {d for r in earlier for d in r.devices}
    cpu, mem = request.cpu, request.mem

    def fits(shown: list[core.NodeState]) -> core.Placement | None:
        try:
            return core.place(shown, request, settings, **options)
        except AllocationError:
            return None

    def shown(some: Iterable[core.NodeState], avoid: bool) -> list[core.NodeState]:
        if not avoid:
            return list(some)
        return [replace(n, devices=tuple(_blank(d) if d.device_id in taken else d for d in n.devices)) for n in some]

    for avoid in (True, False) if taken else (False,):
        state = {n.node_id: n for n in nodes}
        order = sorted(
            (k for k, h in holdings.items() if h.node_id in state), key=lambda k: (ends.get(k) is None, ends.get(k) or 0.0, k)
        )
        released: list[str] = []
        candidates = [n for n in shown(state.values(), avoid) if _may_fit(n, request, settings)]
        placement = fits(candidates) if candidates else None
        for other in order:
            if placement is not None:
                break
            held = holdings[other]
            state[held.node_id] = core.release_placement(state[held.node_id], cpu=held.cpu, mem=held.mem, grants=held.grants)
            released.append(other)
            # only the node that end freed room on can hold it now (nothing else changed): one node to try
            [freed] = shown([state[held.node_id]], avoid)
            placement = fits([freed]) if _may_fit(freed, request, settings) else None
        if placement is None:
            continue
        node = state[placement.node_id]
        last = [ends.get(k) for k in released]
        at = None if None in last or not avoid and taken else max([now] + [t for t in last if t is not None])
        chosen = {g.device_id for g in placement.grants}
        return Reservation(
            key=key,
            name=name,
            node_id=placement.node_id,
            devices=frozenset(chosen),
            labels=device_names(d for d in node.devices if d.device_id in chosen),
            at=at,
            cpu_spare=max(0, node.cpu_total - node.cpu_used - cpu),
            mem_spare=max(0, node.mem_total - node.mem_used - mem),
            waits_for=len(released),
        )
    return None


@dataclass
class Reservations:
    """The reservations of one pass, in queue order, and what later placements on their nodes
    took of their spare CPU cores and memory."""

    held: list[Reservation] = field(default_factory=list)
    used: dict[int, tuple[int, int]] = field(default_factory=dict)  # index in `held` → (cores, bytes) taken

    def add(self, reservation: Reservation) -> None:
        self.held.append(reservation)

    def everywhere(self) -> Reservation | None:
        """The first reservation of every node, or None."""
        return next((r for r in self.held if r.node_id == EVERYWHERE), None)

    def of_mig(self) -> Reservation | None:
        """The first reservation a MIG request may not pass (of the MIG GPUs or of every node)."""
        return next((r for r in self.held if r.node_id in (MIG_GPUS, EVERYWHERE)), None)

    def _overlapping(self, node_id: str, end: float | None) -> Iterable[tuple[int, Reservation]]:
        """The reservations a session on `node_id` ending at `end` (None: unknown) would still
        be running into."""
        for i, r in enumerate(self.held):
            if r.node_id not in (node_id, EVERYWHERE):
                continue
            if end is not None and r.at is not None and end <= r.at:
                continue
            yield i, r

    def conflict(self, placement: core.Placement, *, cpu: int, mem: int, end: float | None) -> Reservation | None:
        """The first reservation `placement` (of a session asking `cpu` cores, `mem` bytes, that
        ends at `end`, epoch seconds; None: no runtime limit) would delay: it shares a reserved
        device, or takes more of the node's CPU cores or memory than the reservation leaves
        spare; None when it delays none."""
        devices = {g.device_id for g in placement.grants}
        for i, r in self._overlapping(placement.node_id, end):
            cores, size = self.used.get(i, (0, 0))
            if r.node_id == EVERYWHERE or devices & r.devices or cores + cpu > r.cpu_spare or size + mem > r.mem_spare:
                return r
        return None

    def take(self, placement: core.Placement, *, cpu: int, mem: int, end: float | None) -> None:
        """A placement that delays none (`conflict` None) was made: it takes of the spare room
        of the reservations on its node that it runs into."""
        for i, _ in self._overlapping(placement.node_id, end):
            cores, size = self.used.get(i, (0, 0))
            self.used[i] = (cores + cpu, size + mem)

    def mask(self, nodes: Sequence[core.NodeState], *, end: float | None) -> list[core.NodeState]:
        """`nodes` as a session ending at `end` may use them: reserved devices shown full, and
        of a reserved node's CPU cores and memory only what its reservations leave spare."""
        out = []
        for node in nodes:
            devices: set[str] = set()
            cpu_free, mem_free = node.cpu_total - node.cpu_used, node.mem_total - node.mem_used
            for i, r in self._overlapping(node.node_id, end):
                cores, size = self.used.get(i, (0, 0))
                devices |= r.devices
                cpu_free, mem_free = min(cpu_free, r.cpu_spare - cores), min(mem_free, r.mem_spare - size)
            if devices or cpu_free < node.cpu_total - node.cpu_used or mem_free < node.mem_total - node.mem_used:
                node = replace(
                    node,
                    devices=tuple(_blank(d) if d.device_id in devices else d for d in node.devices),
                    cpu_used=node.cpu_total - max(0, cpu_free),
                    mem_used=node.mem_total - max(0, mem_free),
                )
            out.append(node)
        return out

    def place_around(
        self,
        nodes: Sequence[core.NodeState],
        *,
        cpu: int,
        mem: int,
        end: float | None,
        place: Callable[[list[core.NodeState] | None], core.Placement],
    ) -> core.Placement:
        """A placement that delays no reservation: `place(None)` (the caller's placement on its
        own nodes), and if that would delay one, `place` on `nodes` masked for a session ending
        at `end` (`mask`). Records what it took (`take`). Raises InsufficientResource naming the
        reservation when only reserved room would hold it, and what `place(None)` raises."""
        placement = place(None)
        blocking = self.conflict(placement, cpu=cpu, mem=mem, end=end)
        if blocking is not None:
            if blocking.node_id == EVERYWHERE:
                raise InsufficientResource(blocking.blocked_reason())
            try:
                placement = place(self.mask(nodes, end=end))
            except (InsufficientResource, NeverSchedulable):
                raise InsufficientResource(blocking.blocked_reason()) from None
        self.take(placement, cpu=cpu, mem=mem, end=end)
        return placement
