"""Preemption with notice (issue 17.2): the scheduler's pass stops preemptible sessions to make
room for a waiting session of higher priority, or of an owner under its fair share — warned
first, stopped FGPU_PREEMPTION_GRACE_SECONDS later — and records for whom. On only with
FGPU_PREEMPTION.

Who goes is the pure rule `accelerators.allocation.preemption.preemption_choice` (the fewest,
youngest preemptible sessions past their minimum runtime, on one node, checked with the real
allocator under the group's options). This module reads the holders, writes the state and sends
the notices. Every step is a function of the database, idempotent, re-run by every pass (beat
runs one every 10 s), so a process that dies half-way leaves nothing the next pass does not
finish (DESIGN.md, "How the system heals"):

- a blocked session W with no victim under notice, which preemption can make fit → `_warn`:
  each victim gets `preempted_for` = W, `preempt_at` = now + grace and a reason; notices after
  commit;
- a victim under notice whose `preempt_at` passed while W still waits → `_stop_due`:
  `session_terminate` with "preempted: …" (its agent sends SIGTERM, then SIGKILL; the stop is
  re-sent by the heartbeat's reconciliation until it ended);
- a victim under notice whose W no longer waits (placed, cancelled) → `_withdraw`: the notice is
  taken back;
- W's victims ended → the pass places W (their allocations were released with them).

Notices: the victim's `status_reason` (its page and `GET /api/v1/sessions/<id>/`, with
`preempt_at` and `preempted_for`), a line in its terminal (task `fgpu.agent.session_notice`),
and W's reason ("waiting for capacity: preempting …"). An ended victim keeps "preempted: …"
as its reason. MIG requests are not preempted for (the MIG planner reuses and destroys idle
instances itself), nor are MIG sessions preempted.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta

from django.conf import settings
from django.db.models import Prefetch
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError
from accelerators.allocation.preemption import Holder, Room, place_on, preemption_choice, release
from sessions import fairshare, mig_scheduling
from sessions.models import ACTIVE_STATUSES, NEXT_VERSION, Allocation, ComputeSession, SessionStatus
from sessions.placement import CAPACITY
from sessions.services import PREEMPTED, session_notice, session_terminate

log = logging.getLogger(__name__)

MAX_WAITERS_PER_PASS = 16  # blocked sessions a pass looks at for preemption (the first in queue order)


def preemption_enabled() -> bool:
    return bool(settings.FGPU_PREEMPTION)


def waiting_reasons(pending: list[ComputeSession]) -> dict:
    """{pk of a PENDING session among `pending`: its reason} for those that sessions are being
    preempted for (under notice, or stopping): "waiting for capacity: preempting …". One query."""
    victims = (
        ComputeSession.objects.filter(preempted_for_id__in=[s.pk for s in pending], status__in=ACTIVE_STATUSES)
        .exclude(preempt_at__isnull=True)
        .select_related("node")
        .order_by("preempt_at", "name")
    )
    by_waiter: dict = {}
    for v in victims:
        by_waiter.setdefault(v.preempted_for_id, []).append(v)
    return {pk: waiter_reason(vs) for pk, vs in by_waiter.items()}


def waiter_reason(victims: list[ComputeSession]) -> str:
    """The reason of a session that `victims` (on one node) are preempted for."""
    when = max(v.preempt_at for v in victims if v.preempt_at is not None)  # all are under notice
    names = ", ".join(v.name for v in victims)
    node = victims[0].node.name if victims[0].node is not None else "its node"
    return f"{CAPACITY}preempting {len(victims)} session(s) on {node} to make room ({names}; stopped at {when:%H:%M:%S} UTC)"


def victim_reason(waiter: ComputeSession, at, why: str) -> str:
    """The reason a session under notice shows while it still runs."""
    return (
        f"to be preempted at {at:%Y-%m-%d %H:%M:%S} UTC to make room for {waiter.name} of "
        f"{waiter.owner.get_username()} ({why}); save your work"
    )


def preemption_pass(*, blocked: list[ComputeSession], scope_of, options_of, now=None) -> dict:
    """One pass's preemption work, inside the scheduler's transaction (its node and device rows
    locked): take back notices whose waiting session no longer waits, stop the victims whose
    time came, and choose victims for the `blocked` sessions (in queue order, at most
    MAX_WAITERS_PER_PASS, waiting for capacity, not MIG) that have none yet. `scope_of(session)`:
    the session's scope nodes (`core.NodeState`, the pass's view); `options_of(session)`: its
    group's `core.place` options. Returns `{"withdrawn", "stopped", "warned": [session ids],
    "for": {waiter id: reason}}` (the reasons to give the waiters now)."""
    now = now or timezone.now()
    warned: list[str] = []
    reasons: dict = {}  # waiter pk → its reason
    out = {"withdrawn": _withdraw(now), "stopped": _stop_due(now), "warned": warned, "for": reasons}
    waiters = [s for s in blocked if s.status_reason.startswith(CAPACITY)][:MAX_WAITERS_PER_PASS]
    if not waiters:
        return out
    busy = set(
        ComputeSession.objects.filter(preempted_for_id__in=[w.pk for w in waiters], status__in=ACTIVE_STATUSES)
        .exclude(preempt_at__isnull=True)
        .values_list("preempted_for_id", flat=True)
    )
    read: dict = {}  # the scope's node names → its holders (read once per pass), and "factors"
    for waiter in waiters:
        if waiter.pk in busy:
            continue
        request = _request_of(waiter)
        if request is None or mig_scheduling.wants_mig(request):
            continue
        nodes = scope_of(waiter)
        names = tuple(n.node_id for n in nodes)
        if names not in read:
            read[names] = session_holders(node_names=list(names))
        holders, stopping, owners = read[names]
        if not any(h.preemptible for h in holders):
            continue
        nodes = [release(n, stopping) for n in nodes]  # what ends anyway frees its room: no preemption for it
        if any(place_on(n, request, _settings(request), options_of(waiter)) for n in nodes):
            continue
        if "factors" not in read:  # once a pass: every active session's owner and the waiters'
            owners_now = set(ComputeSession.objects.filter(status__in=ACTIVE_STATUSES).values_list("owner_id", flat=True))
            read["factors"] = fairshare.owner_factors(owners_now | {w.owner_id for w in waiters})
        factors = read["factors"]
        holders = [replace(h, factor=factors.get(owners[h.session_id], 1.0)) for h in holders]
        room = preemption_choice(
            nodes,
            holders,
            request,
            _settings(request),
            priority=waiter.priority,
            factor=factors.get(waiter.owner_id, 1.0),
            now=now.timestamp(),
            options=options_of(waiter),
        )
        if room is None or not room.victims:
            continue
        reasons[waiter.pk] = _warn(waiter, room, now)
        warned.extend(v.session_id for v in room.victims)
        del read[names]  # its victims are under notice now: read again for the next waiter
    return out


def session_holders(*, node_names: list[str]) -> tuple[list[Holder], list[Holder], dict[str, int]]:
    """The sessions holding resources on `node_names` as the pure rule sees them: (holders that
    still run, holders already stopping: TERMINATING, {session id: owner's user id}). A session
    is `preemptible` here only while RUNNING, not under notice already, and holding no MIG
    instance; `factor` 1.0 (the caller sets it); `started_at` its start (epoch seconds);
    `request` its own (None where the slot no longer allows it). Three queries."""
    sessions = (
        ComputeSession.objects.filter(node__name__in=node_names, status__in=ACTIVE_STATUSES)
        .select_related("node")
        .prefetch_related(
            Prefetch("allocations", queryset=Allocation.objects.filter(released_at__isnull=True), to_attr="live"), "gpu_instances"
        )
    )
    running: list[Holder] = []
    stopping: list[Holder] = []
    owners: dict[str, int] = {}
    for s in sessions:
        grants = tuple(core.DeviceGrant(str(a.device_id), a.shares, a.memory, a.procs) for a in s.live)
        started = s.started_at or s.scheduled_at or s.created_at
        preemptible = s.preemptible and s.status == SessionStatus.RUNNING and s.preempt_at is None and not s.gpu_instances.all()
        assert s.node is not None  # an active session on one of `node_names`
        holder = Holder(
            str(s.pk),
            s.node.name,
            grants,
            cpu=s.cpu,
            mem=s.mem,
            started_at=started.timestamp(),
            min_runtime=s.min_runtime,
            preemptible=preemptible,
            priority=s.priority,
            name=s.name,
            request=_request_of(s),
        )
        owners[holder.session_id] = s.owner_id
        (stopping if s.status == SessionStatus.TERMINATING else running).append(holder)
    return running, stopping, owners


def _request_of(session: ComputeSession):
    from sessions.selectors import session_request

    try:
        return session_request(session)
    except (AllocationError, KeyError, TypeError, ValueError):  # a spec this version cannot read
        return None


def _settings(request):
    from sessions.placement import request_settings

    return request_settings(request)


def _why(waiter: ComputeSession, room: Room) -> str:
    """Why the waiter may preempt: its priority, else its fair share."""
    victims = room.victims
    if all(v.priority < waiter.priority for v in victims):
        return f"priority {waiter.priority} over {max(v.priority for v in victims)}"
    return "its owner is under their fair share"


def _warn(waiter: ComputeSession, room: Room, now) -> str:
    """Put `room`'s victims under notice for `waiter` (compare-and-set: only sessions still
    RUNNING and not under notice); notices after commit. Returns the waiter's reason."""
    at = now + timedelta(seconds=settings.FGPU_PREEMPTION_GRACE_SECONDS)
    why = _why(waiter, room)
    reason = victim_reason(waiter, at, why)
    ids = [v.session_id for v in room.victims]
    ComputeSession.objects.filter(pk__in=ids, status=SessionStatus.RUNNING, preempt_at__isnull=True).update(
        preempted_for=waiter, preempt_at=at, status_reason=reason, version=NEXT_VERSION
    )
    victims = list(ComputeSession.objects.filter(pk__in=ids, preempted_for=waiter).select_related("node", "owner"))
    sessions_moved, lost = room.cost(now.timestamp())
    log.info(
        "preemption: %d session(s) on %s (%s) warned for %s, stopped at %s; %.0f fGPU-seconds of work",
        len(victims),
        room.node_id,
        ", ".join(ids),
        waiter.pk,
        at.isoformat(),
        lost,
    )
    for victim in victims:
        session_notice(
            victim,
            f"this session will be preempted at {at:%H:%M:%S} UTC (in "
            f"{settings.FGPU_PREEMPTION_GRACE_SECONDS} s) to make room for {waiter.name} of "
            f"{waiter.owner.get_username()} ({why}): save your work",
        )
    return waiter_reason(victims) if victims else waiter.status_reason


def _stop_due(now) -> list[str]:
    """Stop every victim whose notice ran out while its waiting session still waits; returns their ids."""
    due = list(
        ComputeSession.objects.filter(
            preempt_at__lte=now,
            preempted_for__status=SessionStatus.PENDING,
            status__in=(SessionStatus.SCHEDULED, SessionStatus.PREPARING, SessionStatus.RUNNING),
        ).select_related("node", "preempted_for", "preempted_for__owner")
    )
    for victim in due:
        waiter = victim.preempted_for
        assert waiter is not None  # the filter follows it
        session_terminate(
            session=victim,
            reason=f"{PREEMPTED}stopped to make room for {waiter.name} of "
            f"{waiter.owner.get_username()} (session {waiter.pk}), after "
            f"{settings.FGPU_PREEMPTION_GRACE_SECONDS} s of notice",
        )
    return [str(v.pk) for v in due]


def _withdraw(now) -> list[str]:
    """Take back the notices of victims whose waiting session no longer waits (placed elsewhere,
    cancelled, ended) or is gone, before their time; returns their ids."""
    stale = list(
        ComputeSession.objects.filter(preempt_at__isnull=False, status=SessionStatus.RUNNING)
        .exclude(preempted_for__status=SessionStatus.PENDING)
        .select_related("node")
    )
    for victim in stale:
        if ComputeSession.objects.filter(pk=victim.pk, preempt_at=victim.preempt_at).update(
            preempt_at=None, status_reason="", version=NEXT_VERSION
        ):
            session_notice(victim, "the preemption of this session is withdrawn: the session it made room for no longer waits")
    return [str(v.pk) for v in stale]
