"""Preemption with notice (issues 17.2, 32.2): the scheduler's pass stops preemptible sessions to
make room for a waiting session of higher priority, or of an owner under its fair share — warned
and signalled first, stopped FGPU_PREEMPTION_GRACE_SECONDS later — records for whom, and launches
them again once they ended. Victims are chosen only with FGPU_PREEMPTION; the notices (a
compaction's moves are under notice the same way, sessions.scheduling.compaction) are kept by every pass.

Who goes is the pure rule `accelerators.allocation.preemption.preemption_choice` (the lowest
priority first, then the least work lost, then the fewest and youngest, among preemptible
sessions past their minimum runtime, on one node, checked with the real allocator under the
group's options; never a session of higher priority than the waiting one). This module reads the
holders, writes the state and sends the notices. Every step is a function of the database,
idempotent, re-run by every pass (beat runs one every 10 s), so a process that dies half-way
leaves nothing the next pass does not finish (DESIGN.md, "How the system heals"):

- a blocked session W with no victim under notice, which preemption can make fit → `_warn`:
  each victim gets `preempted_for` = W, `preempt_at` = now + grace and a reason;
- every victim under notice that still runs → `notices_send`: its agent is sent `pty.preempt`
  (protocol.channel.PtyPreempt, sealed with its node's key) on every pass while the notice
  stands; the agent acts once per notice: a line in the session's output (its terminal and its
  log, which `fgpu logs` reads) and the session's signal (`preempt_signal`: the launch's, else
  its image's, else SIGTERM; Slurm's `--signal`) to its command's process group (a container:
  `docker kill --signal`);
- a victim under notice whose `preempt_at` passed while W still waits → `_stop_due`:
  `session_terminate` with "preempted: …" (its agent sends SIGTERM, then SIGKILL; the stop is
  re-sent by the heartbeat's reconciliation until it ended);
- a victim under notice whose W no longer waits (placed, cancelled) → `_withdraw`: the notice is
  taken back;
- a victim under notice that ended (stopped, or it exited on its signal), unless its launch said
  `requeue: false` or its owner ended it → `_requeue_ended`: a new PENDING session asking the
  same (request, command, image, priority, preemption settings), `requeued_from` it and
  `requeued_as` on it, with the original's `created_at` so it keeps its place by arrival. A new
  session rather than the same one back to PENDING: a session's id names one run — its log,
  allocations, exit code and the agent's idempotent start and stop by id — and the old id stays
  meaningful: its page and API say "requeued as <id>";
- W's victims ended → the pass places W (their allocations were released with them).

A node's drain with eviction (issue 37.4, `accelerators.drain`) takes the same path without a
waiting session (`preempted_for` empty): every pass puts each RUNNING session on an evicting
node that has no notice under notice (`_drain_notices`: "to be evicted at … : node n1 is
drained by …"), the notices are sent as above, `_drain_stop_due` stops it at its time ("preempted:
node n1 drained …"), and it is requeued as a victim is (on another node: the drained one takes
no new session). Undrained before its time, its notice is taken back (`_withdraw`).

Notices: the victim's `status_reason` (its page and `GET /api/v1/sessions/<id>/`, with
`preempt_at`, which the page counts down, and `preempted_for`), the line and the signal, and W's
reason ("waiting for capacity: preempting …"). An ended victim keeps "preempted: …" as its
reason. MIG requests are not preempted for (the MIG planner reuses and destroys idle instances
itself), nor are MIG sessions preempted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch, Q
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError
from accelerators.allocation.preemption import Holder, Room, place_on, preemption_choice, release
from sessions.scheduling import fairshare
from sessions.scheduling import mig as mig_scheduling
from protocol.channel import MAX_NOTICE_CHARS, PtyPreempt
from sessions.lifecycle import events
from sessions.models import ACTIVE_STATUSES, FINAL_STATUSES, NEXT_VERSION, Allocation, ComputeSession, SessionStatus
from sessions.scheduling.placement import CAPACITY
from sessions.selectors import session_name_unused
from sessions.lifecycle.services import PREEMPTED, RECLAIMED, REQUESTED, session_notice, session_terminate
from accelerators.models import Node

log = logging.getLogger(__name__)

MAX_WAITERS_PER_PASS = 16  # blocked sessions a pass looks at for preemption (the first in queue order)
REQUEUE_WINDOW = timedelta(hours=1)  # a victim that ended longer ago than this is not launched again (older releases')
# A victim is launched again only once the session it made room for has started (or no longer waits), so that
# its copy, which keeps its arrival, cannot take that room back (a compaction's move: the same priority, maybe a
# better fair share); past this it is launched again all the same (the room went to someone else meanwhile).
REQUEUE_AFTER_WAITER = timedelta(minutes=5)
UNDER_NOTICE = (SessionStatus.SCHEDULED, SessionStatus.PREPARING, SessionStatus.RUNNING)


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
    owners = {s.pk: s.owner for s in pending}
    return {pk: waiter_reason(vs, owner=owners.get(pk)) for pk, vs in by_waiter.items()}


def waiter_reason(victims: list[ComputeSession], *, owner=None) -> str:
    """The reason of a session that `victims` (on one node) are preempted for, as its `owner`
    reads it (the waiting session's status_reason): the names of the owner's own victims (all
    for an administrator, or with no owner given), the others counted ("2 of other users";
    issue 36.3: the ETA panel named them in one sentence and hid them in the next)."""
    when = max(v.preempt_at for v in victims if v.preempt_at is not None)  # all are under notice
    named = [v.name for v in victims if owner is None or owner.is_staff or v.owner_id == owner.pk]
    others = len(victims) - len(named)
    names = ", ".join(named + ([f"{others} of other users" if others > 1 else "1 of another user"] if others else []))
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
    time came, launch again those that ended, choose victims for the `blocked` sessions (in queue
    order, at most MAX_WAITERS_PER_PASS, waiting for capacity, not MIG) that have none yet, and
    send every standing notice to its agent (after commit). `blocked`: empty where preemption is
    off (the notices a compaction gave are still kept). `scope_of(session)`: the session's scope
    nodes (`core.NodeState`, the pass's view); `options_of(session)`: its group's `core.place`
    options. Returns `{"withdrawn", "stopped", "requeued", "warned", "signalled": [session ids],
    "for": {waiter id: reason}}` (the reasons to give the waiters now). A node drained with
    eviction puts its running sessions under notice first (`_drain_notices`; their ids are
    among "warned"). Without a notice standing or ended within REQUEUE_WINDOW, a running session
    on a node drained with eviction, and nothing blocked: one query."""
    now = now or timezone.now()
    warned: list[str] = []
    reasons: dict = {}  # waiter pk → its reason
    out: dict = {"withdrawn": [], "stopped": [], "requeued": [], "warned": warned, "signalled": [], "for": reasons}
    noticed = Q(preempt_at__isnull=False) & (Q(status__in=UNDER_NOTICE) | _requeue_due(now))
    evicted = Q(status=SessionStatus.RUNNING, preempt_at__isnull=True, node__drain_since__isnull=False, node__drain_evict=True)
    standing = ComputeSession.objects.filter(noticed | evicted).exists()
    if standing:
        warned.extend(_drain_notices(now))
        out.update(withdrawn=_withdraw(now), stopped=_stop_due(now) + _drain_stop_due(now), requeued=_requeue_ended(now))
    waiters = [s for s in blocked if s.status_reason.startswith(CAPACITY)][:MAX_WAITERS_PER_PASS]
    if waiters:
        _choose(waiters, scope_of, options_of, now, warned, reasons)
    if warned or standing:
        out["signalled"] = notices_send(now)
    return out


def _choose(waiters: list[ComputeSession], scope_of, options_of, now, warned: list[str], reasons: dict) -> None:
    """Victims for each of `waiters` that has none under notice yet (see `preemption_pass`)."""
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


def session_holders(
    *, node_names: list[str], sessions: Iterable[ComputeSession] | None = None
) -> tuple[list[Holder], list[Holder], dict[str, int]]:
    """The sessions holding resources on `node_names` as the pure rule sees them: (holders that
    still run, holders already stopping: TERMINATING, {session id: owner's user id}), each list
    by arrival, then id. A session is `preemptible` here only while RUNNING, not under notice
    already, and holding no MIG instance; `factor` 1.0 (the caller sets it); `started_at` its
    start (epoch seconds); `request` its own (None where the slot no longer allows it). Three
    queries; none where `sessions` gives those active sessions already read, in that order, with
    their node, live allocations (`live`) and GPU instances (`kept_sessions.active_on`'s)."""
    if sessions is None:
        sessions = (
            ComputeSession.objects.filter(node__name__in=node_names, status__in=ACTIVE_STATUSES)
            .select_related("node")
            .prefetch_related(
                Prefetch(
                    "allocations", queryset=Allocation.objects.filter(released_at__isnull=True).order_by("pk"), to_attr="live"
                ),
                "gpu_instances",
            )
            .order_by("created_at", "pk")
        )
    running: list[Holder] = []
    stopping: list[Holder] = []
    owners: dict[str, int] = {}
    for s in sessions:
        live: list = getattr(s, "live", [])  # the prefetch's (to_attr)
        grants = tuple(core.DeviceGrant(str(a.device_id), a.shares, a.memory, a.procs) for a in live)
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
    from sessions.scheduling.placement import request_settings

    return request_settings(request)


def _why(waiter: ComputeSession, room: Room) -> str:
    """Why the waiter may preempt: its priority, else its fair share."""
    victims = room.victims
    if all(v.priority < waiter.priority for v in victims):
        return f"priority {waiter.priority} over {max(v.priority for v in victims)}"
    return "its owner is under their fair share"


def _warn(waiter: ComputeSession, room: Room, now) -> str:
    """Put `room`'s victims under notice for `waiter` (`notice_give`). Returns the waiter's reason."""
    at = now + timedelta(seconds=settings.FGPU_PREEMPTION_GRACE_SECONDS)
    ids = [v.session_id for v in room.victims]
    victims = notice_give(waiter=waiter, ids=ids, reason=victim_reason(waiter, at, _why(waiter, room)), at=at)
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
    return waiter_reason(victims, owner=waiter.owner) if victims else waiter.status_reason


def notice_give(*, waiter: ComputeSession, ids: list[str], reason: str, at) -> list[ComputeSession]:
    """Put sessions `ids` under notice for `waiter` (compare-and-set: only those still RUNNING and
    not under notice): `preempted_for`, `preempt_at` = `at`, `reason`; their pages are told
    after commit, their agents by `notices_send` (this pass's, and every pass's while the notice
    stands). Returns those now under notice for `waiter` (with their node and owner)."""
    ComputeSession.objects.filter(pk__in=ids, status=SessionStatus.RUNNING, preempt_at__isnull=True).update(
        preempted_for=waiter, preempt_at=at, status_reason=reason, version=NEXT_VERSION
    )
    victims = list(ComputeSession.objects.filter(pk__in=ids, preempted_for=waiter, preempt_at=at).select_related("node", "owner"))
    for victim in victims:
        events.session_notify(victim)
    return victims


def notice_line(session: ComputeSession, signal: str, now) -> str:
    """The line a session under notice shows in its output (terminal and log) when its agent
    acts on the notice: when, the signal, and its reason (what happens, when, for whom)."""
    return f"preemption notice at {now:%H:%M:%S} UTC, {signal} sent: {session.status_reason}"[:MAX_NOTICE_CHARS]


def notices_send(now) -> list[str]:
    """After commit, `pty.preempt` to the agent of every session under notice that still runs
    (before its `preempt_at`): its line and its signal, acted on once per notice by the agent
    (protocol.channel.PtyPreempt; the notice's id is its `preempt_at`). Returns their ids. One query."""
    standing = list(
        ComputeSession.objects.filter(preempt_at__gt=now, status=SessionStatus.RUNNING, node__isnull=False).select_related(
            "node", "image"
        )
    )
    sends = []
    for session in standing:
        assert session.node is not None and session.preempt_at is not None  # the filter
        signal = session.preempt_signal_sent
        command = PtyPreempt(
            session_id=str(session.pk),
            signal=signal,
            text=notice_line(session, signal, now),
            notice=session.preempt_at.isoformat(),
        )
        sends.append((events.agent_link(session.node), str(session.pk), command.to_dict()))
    if sends:
        transaction.on_commit(partial(_send_all, sends))
    return [sid for _, sid, _ in sends]


def _send_all(sends: list) -> None:
    for link, session_id, message in sends:
        events.pty_send(link, session_id, message)


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


def _requeue_ended(now) -> list[str]:
    """Launch again every victim under notice that ended (stopped at its time, or it exited on its
    signal) within REQUEUE_WINDOW, unless its launch said `requeue: false` or its owner (or an
    idle reclamation) ended it: `session_requeue`; not while the session it made room for still
    waits (up to REQUEUE_AFTER_WAITER after its end). Returns the new sessions' ids."""
    ended = (
        ComputeSession.objects.filter(preempt_at__isnull=False)  # a waiter's victim, or a drain's (none)
        .filter(_requeue_due(now))
        .exclude(preempted_for__status=SessionStatus.PENDING, terminated_at__gt=now - REQUEUE_AFTER_WAITER)
        .select_related("owner", "image", "preempted_for__owner")
    )
    again = []
    for session in ended:
        requeued = session_requeue(session)
        if requeued is not None:
            again.append(str(requeued.pk))
    return again


def _requeue_due(now) -> Q:
    """The sessions (among those put under notice) to launch again: ended within REQUEUE_WINDOW,
    launched with `requeue`, not requeued yet, and not ended by their owner or an idle
    reclamation (their reasons' REQUESTED, RECLAIMED)."""
    return (
        Q(status__in=FINAL_STATUSES, requeue=True, requeued_as__isnull=True, terminated_at__gte=now - REQUEUE_WINDOW)
        & ~Q(status_reason__startswith=REQUESTED)
        & ~Q(status_reason__startswith=RECLAIMED)
    )


def session_requeue(session: ComputeSession) -> ComputeSession | None:
    """A new PENDING session asking what ended `session` asked (owner, name — "<name>-2" where a
    session of the owner launched since holds it —, request, command,
    image, priority, preemption settings), `requeued_from` it, with its `created_at` (its place by
    arrival: the queue orders by priority, fair share, then `created_at`); `session` gets
    `requeued_as` and "requeued as session <id>" in its reason. Compare-and-set: None (nothing
    created) where it was requeued already. Its quota claim moves with it (the old one ended)."""
    again = ComputeSession.objects.create(
        owner=session.owner,
        # its name, unless the owner launched a session of that name since it ended (issue 36.6)
        name=session_name_unused(owner=session.owner, name=session.name),
        resources=session.resources,
        request_spec=session.request_spec,
        slot_name=session.slot_name,
        slot_subtype=session.slot_subtype,
        amount=session.amount,
        cpu=session.cpu,
        mem=session.mem,
        command=session.command,
        image=session.image,
        priority=session.priority,
        preemptible=session.preemptible,
        min_runtime=session.min_runtime,
        preempt_signal=session.preempt_signal,
        requeue=session.requeue,
        requeued_from=session,
        status_reason=f"requeued: session {session.pk} was preempted; it keeps its place by arrival",
    )
    reason = session.status_reason
    waiter = session.preempted_for
    if not reason.startswith(PREEMPTED):  # it ended on its own during its notice (on its signal, most likely)
        whom = f" to make room for {waiter.name} of {waiter.owner.get_username()} (session {waiter.pk})" if waiter else ""
        reason = f"{PREEMPTED}ended during its notice{whom}: {reason or 'its process exited'}"
    if not ComputeSession.objects.filter(pk=session.pk, requeued_as__isnull=True).update(
        requeued_as=again, status_reason=f"{reason}; requeued as session {again.pk}", version=NEXT_VERSION
    ):
        again.delete()
        return None
    ComputeSession.objects.filter(pk=again.pk).update(created_at=session.created_at)
    again.refresh_from_db()
    session.refresh_from_db(fields=["requeued_as", "status_reason", "version"])
    events.session_notify(again)
    events.session_notify(session)
    log.info("preemption: session %s requeued as %s", session.pk, again.pk)
    return again


def _withdraw(now) -> list[str]:
    """Take back the notices of victims whose waiting session no longer waits (placed elsewhere,
    cancelled, ended), and of a drain's (no waiting session) whose node no longer evicts
    (undrained), before their time; returns their ids."""
    evicting = Q(node__drain_since__isnull=False, node__drain_evict=True)
    stale = list(
        ComputeSession.objects.filter(preempt_at__isnull=False, status=SessionStatus.RUNNING)
        .filter(
            (Q(preempted_for__isnull=False) & ~Q(preempted_for__status=SessionStatus.PENDING))
            | (Q(preempted_for__isnull=True) & ~evicting)
        )
        .select_related("node")
    )
    for victim in stale:
        if ComputeSession.objects.filter(pk=victim.pk, preempt_at=victim.preempt_at).update(
            preempt_at=None, status_reason="", version=NEXT_VERSION
        ):
            why = (
                "the session it made room for no longer waits"
                if victim.preempted_for_id is not None
                else "its node is back in service"
            )
            session_notice(victim, f"the preemption of this session is withdrawn: {why}")
    return [str(v.pk) for v in stale]


def drain_reason(node: Node, at) -> str:
    """The reason a running session on `node`, drained with eviction, shows under notice."""
    why = f": {node.drain_reason}" if node.drain_reason else ""
    by = f" by {node.drain_by}" if node.drain_by else ""
    return f"to be evicted at {at:%Y-%m-%d %H:%M:%S} UTC: node {node.name} is drained{by}{why}; save your work"


def _drain_notices(now) -> list[str]:
    """Put under notice (`preempt_at` = now + FGPU_PREEMPTION_GRACE_SECONDS, no waiting session,
    `drain_reason`) every RUNNING session without one on a node drained with eviction
    (accelerators.drain); re-run by every pass that finds one (`preemption_pass`), so a session
    that starts running on it later gets its notice too. Returns their ids."""
    nodes = list(Node.objects.filter(drain_since__isnull=False, drain_evict=True))
    if not nodes:
        return []
    at = now + timedelta(seconds=settings.FGPU_PREEMPTION_GRACE_SECONDS)
    noticed = []
    for node in nodes:
        ids = list(
            ComputeSession.objects.filter(node=node, status=SessionStatus.RUNNING, preempt_at__isnull=True).values_list(
                "pk", flat=True
            )
        )
        if not ids:
            continue
        ComputeSession.objects.filter(pk__in=ids, status=SessionStatus.RUNNING, preempt_at__isnull=True).update(
            preempted_for=None, preempt_at=at, status_reason=drain_reason(node, at), version=NEXT_VERSION
        )
        for victim in ComputeSession.objects.filter(pk__in=ids, preempt_at=at).select_related("node", "owner"):
            events.session_notify(victim)
            noticed.append(str(victim.pk))
        log.info("drain: %d session(s) on %s put under notice, evicted at %s", len(ids), node.name, at.isoformat())
    return noticed


def _drain_stop_due(now) -> list[str]:
    """Stop every session a drain put under notice (no waiting session) whose time came while
    its node still evicts; returns their ids. It is requeued once it ended (`_requeue_ended`)."""
    due = list(
        ComputeSession.objects.filter(
            preempt_at__lte=now,
            preempted_for__isnull=True,
            node__drain_since__isnull=False,
            node__drain_evict=True,
            status__in=(SessionStatus.SCHEDULED, SessionStatus.PREPARING, SessionStatus.RUNNING),
        ).select_related("node")
    )
    for victim in due:
        assert victim.node is not None  # the filter follows it
        by = f" by {victim.node.drain_by}" if victim.node.drain_by else ""
        why = f": {victim.node.drain_reason}" if victim.node.drain_reason else ""
        session_terminate(
            session=victim,
            reason=f"{PREEMPTED}node {victim.node.name} drained{by}{why}; stopped after "
            f"{settings.FGPU_PREEMPTION_GRACE_SECONDS} s of notice",
        )
    return [str(v.pk) for v in due]
