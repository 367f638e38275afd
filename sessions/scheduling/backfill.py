"""The scheduler pass's backfill reservations (issue 32.1), read from the database: where a
session overtaken as often as FGPU_BACKFILL_LIMIT allows reserves, and from when. The rule
itself is pure (`accelerators.allocation.reservation`); this module gives it the pass's view
of the session's scope, the sessions holding room there and their expected ends
(`sessions.scheduling.eta.expected_end`, the latest: as Slurm's backfill takes the running jobs' time
limits), so the pass and the ETA's replay reserve alike.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError, InsufficientResource
from accelerators.allocation.reservation import Holding, Reservation, Reservations, reservation_find
from sessions.scheduling import eta
from sessions.scheduling import mig as mig_scheduling
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, SessionStatus
from sessions.scheduling.placement import PlacementScope, ReadView, runtime_limits
from sessions.selectors import session_request


def reservation_for(
    *,
    session: ComputeSession,
    request: core.ResourceRequest,
    scope: Callable[[], PlacementScope],
    pure_settings,
    now: datetime,
    earlier: list[Reservation],
    cache: dict | None = None,
) -> Reservation | None:
    """Where PENDING `session` (its normalised `request`) reserves in this pass
    (`reservation_find`): on the nodes of its `scope()` (its resource group, slot and image, as
    the pass holds them: rows locked, the pass's placements applied and written), once the
    active sessions there end at their latest expected end (`eta.expected_end`; None when
    unknown). A MIG request holds the MIG GPUs (`Reservation.mig`: its instance is not planned
    ahead). None when it would not fit even with them all ended (it waits for something else).
    One query for the sessions, one for their allocations, and the ETA's reads of their
    policies and histories, kept in `cache` (by node set) for the next reservation on the same
    nodes: the caller empties it when it places a session."""
    if mig_scheduling.wants_mig(request):
        return Reservation.mig(str(session.pk), session.name)
    room = scope()
    cache = {} if cache is None else cache
    nodes = frozenset(room.rows)
    if nodes not in cache:
        cache[nodes] = _held_on(nodes, now)
    holdings, ends = cache[nodes]
    return reservation_find(
        room.nodes,
        key=str(session.pk),
        name=session.name,
        request=request,
        settings=pure_settings,
        options=room.options,
        holdings=holdings,
        ends=ends,
        now=now.timestamp(),
        earlier=earlier,
    )


def _held_on(nodes: frozenset[str], now: datetime) -> tuple[dict[str, Holding], dict[str, float | None]]:
    """What the active sessions on `nodes` (names) hold, and their latest expected ends (epoch
    seconds; None: unknown), by session id."""
    active = list(
        ComputeSession.objects.filter(status__in=ACTIVE_STATUSES, node__name__in=list(nodes)).select_related(
            "node", "owner", "image"
        )
    )
    grants: dict[str, list[core.DeviceGrant]] = {}
    rows = Allocation.objects.filter(session__in=active, released_at__isnull=True).values_list(
        "session_id", "device_id", "shares", "memory", "procs"
    )
    for session_id, device_id, shares, memory, procs in rows:
        grants.setdefault(str(session_id), []).append(core.DeviceGrant(str(device_id), shares, memory, procs))
    holdings = {str(s.pk): Holding(s.node.name, s.cpu, s.mem, tuple(grants.get(str(s.pk), ()))) for s in active if s.node}
    facts = eta._Facts(now=now, sessions=active)
    ends = {str(s.pk): eta.expected_end(s, facts).latest for s in active}
    return holdings, ends


class PreviewView(ReadView):
    """`placement_decide`'s view for the launch preview: a `ReadView` (no locks) whose
    placements go around the reservations the next pass would make for the PENDING sessions
    overtaken as often as FGPU_BACKFILL_LIMIT allows (priority, then arrival; read once), for a
    session that would run at most its resource group's maximum lifetime (`runtime_limits`)."""

    def __init__(self) -> None:
        self._around: Reservations | None = None
        self._held: dict = {}  # reservation_for's cache: nothing is placed here

    def reservations(self) -> Reservations:
        if self._around is None:
            self._around = Reservations()
            now = timezone.now()
            holders = ComputeSession.objects.filter(
                status=SessionStatus.PENDING, overtaken__gte=settings.FGPU_BACKFILL_LIMIT
            ).select_related("image")
            for holder in holders.order_by("-priority", "created_at", "pk"):
                try:
                    request = session_request(holder)
                    pure_settings = self.settings(request)
                except AllocationError:
                    continue
                image = holder.image.reference if holder.image else ""
                found = reservation_for(
                    session=holder,
                    request=request,
                    scope=lambda: PlacementScope.read(request, image=image),  # noqa: B023 (called at once)
                    pure_settings=pure_settings,
                    now=now,
                    earlier=self._around.held,
                    cache=self._held,
                )
                if found is not None:
                    self._around.add(found)
        return self._around

    def _end(self, request: core.ResourceRequest) -> float | None:
        limit = runtime_limits().get(request.resource_group)
        return None if limit is None else timezone.now().timestamp() + limit

    def mig(self, request, image: str):
        held = self.reservations().of_mig()
        if held is not None:
            raise InsufficientResource(held.blocked_reason())
        return super().mig(request, image)

    def place(self, request: core.ResourceRequest, pure_settings, image: str) -> core.Placement:
        around = self.reservations()
        scope = PlacementScope.read(request, image=image)
        return scope.place_around(request, pure_settings, around, self._end(request) if around.held else None)
