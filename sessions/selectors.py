"""Reads of compute sessions, always through the permission-checking fetch helpers."""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeGuard, cast

from django.core.exceptions import ValidationError
from django.db.models import Prefetch
from django.http import Http404

from accelerators.allocation import core
from accelerators.allocation.mig import MigResourceRequest
from accelerators.allocation.requests import describe_request, request_from_spec
from protocol.units import format_binary_size
from accelerators.models import GpuInstance, MigMode
from accelerators.selectors import SlotFormats, slot_format_get
from sessions.models import Allocation, ComputeSession


def sessions_shown(*, gpu_instances: bool = True):
    """Every session, newest first, read with what SessionSerializer shows of it, so that any
    number of them costs the same three queries: the sessions joined with their owner, node,
    image and reclamation warning (usage's SessionActivity); `allocation_list` (their
    allocations with their devices, in device order); and `gpu_instance_list` (their GPU
    instances with their GPUs). Lists rather than the related managers: Django builds a queryset
    per session and relation to hold a prefetch in a manager. (Joined, not prefetched: a page is
    mostly served from kept shapes, sessions.api.shapes, so the reads that matter are one
    session's, a notice's or an answer's, where each query counts.) Without `gpu_instances`,
    `session_gpu_instance` reads a MIG session's when asked."""
    sessions = ComputeSession.objects.select_related("owner", "node", "image", "activity").prefetch_related(
        Prefetch("allocations", queryset=Allocation.objects.select_related("device"), to_attr="allocation_list")
    )
    if not gpu_instances:
        return sessions
    return sessions.prefetch_related(
        Prefetch("gpu_instances", queryset=GpuInstance.objects.select_related("parent"), to_attr="gpu_instance_list")
    )


def sessions_shown_by_id(ids: Collection) -> list[ComputeSession]:
    """The sessions `ids`, in no particular order, read as `sessions_shown` reads them, but for one
    session without its GPU instances: `session_gpu_instance` reads that of a MIG session when
    asked (one query then; none for the others, most sessions). A notice's or an answer's read:
    2 queries instead of 3 for one non-MIG session (issue 14), 3 for any number."""
    return list(sessions_shown(gpu_instances=len(ids) != 1).filter(pk__in=ids).order_by())


def session_list_for(*, user):
    """Sessions `user` may see, as `sessions_shown` reads them: all for staff, their own
    otherwise; newest first."""
    sessions = sessions_shown()
    return sessions if user.is_staff else sessions.filter(owner=user)


def session_get_for(*, user, session_id, related: tuple[str, ...] | None = None) -> ComputeSession:
    """The session if `user` owns it or is staff, read as `sessions_shown` reads it, or with just
    the relations in `related` (one query: the app proxy's per-request check). Raises Http404
    otherwise, so ids of other users' sessions do not leak (404, never 403)."""
    if related is None:
        return _visible_one(sessions_shown(), user=user, session_id=session_id)
    return _visible_one(ComputeSession.objects.select_related(*related), user=user, session_id=session_id)


def session_to_change_for(*, user, session_id) -> ComputeSession:
    """The session with its node only (one query), if `user` owns it or is staff, for a write
    that then answers with its shown state (`session_get_for` reads all that is shown). Raises
    Http404 as `session_get_for` does."""
    return _visible_one(ComputeSession.objects.select_related("node"), user=user, session_id=session_id)


def _visible_one(sessions, *, user, session_id) -> ComputeSession:
    """The one of `sessions` with `session_id` if `user` owns it or is staff; Http404 otherwise,
    also for an id that is no UUID (one rule for every read of one session by a caller)."""
    try:
        return (sessions if user.is_staff else sessions.filter(owner=user)).get(pk=session_id)
    except (ComputeSession.DoesNotExist, ValidationError, ValueError, TypeError):
        raise Http404("no such session") from None


def session_name_holder(*, owner, name: str) -> ComputeSession | None:
    """`owner`'s session named `name` that has not ended (status not TERMINATED, ERROR or
    CANCELLED), None when the name is free: a user's sessions not ended have distinct names
    (constraint "session_name_unique_live"; issue 36.6)."""
    from sessions.models import FINAL_STATUSES

    live = ComputeSession.objects.filter(owner=owner, name=name).exclude(status__in=FINAL_STATUSES)
    return live.only("id", "name", "status").first()


def session_name_unused(*, owner, name: str, max_length: int = 64) -> str:
    """`name` where no session of `owner` not ended holds it, else the first of "<name>-2",
    "<name>-3", … (cut to `max_length` characters) that none holds: the name a session made for
    the user (a preempted one launched again) takes."""
    candidate, n = name, 1
    while session_name_holder(owner=owner, name=candidate) is not None:
        n += 1
        suffix = f"-{n}"
        candidate = name[: max_length - len(suffix)] + suffix
    return candidate


def session_allocations(session: ComputeSession) -> list[Allocation]:
    """The session's allocations (released ones too) with their devices, in device order: the
    list `sessions_shown` read with it, else one query."""
    found = getattr(session, "allocation_list", None)
    return found if found is not None else list(session.allocations.select_related("device"))


def session_gpu_instance(session: ComputeSession) -> GpuInstance | None:
    """The GPU instance the session holds, with its GPU, or None: from the list `sessions_shown`
    read with it, else one query."""
    found = getattr(session, "gpu_instance_list", None)
    if found is None:
        found = list(session.gpu_instances.select_related("parent")[:1])
    return found[0] if found else None


def session_request(session: ComputeSession) -> core.ResourceRequest:
    """The session's normalised request (sessions created before request_spec existed are
    rebuilt from their columns)."""
    if session.request_spec:
        return request_from_spec(session.request_spec)
    kind = cast(core.RequestKind, session.slot_subtype) if session.slot_name else "none"  # a subtype is a kind
    return core.ResourceRequest(kind=kind, amount=session.amount, cpu=session.cpu, mem=session.mem, slot=session.slot_name)


def request_configuration(request: core.ResourceRequest, *, slot_formats: SlotFormats | None = None) -> str:
    """A request formatted by the slot formats: "0.50 fGPU · 1 core · 1 GiB", or for per-device
    styles "2 GPU × 4 GiB, 60% cores · 1 core · 1 GiB". `slot_formats`: the request's
    SlotFormats, for a page of many (None: one query)."""
    parts = []
    if request.kind in ("per_device", "mig"):
        parts.append(describe_request(request))
    elif request.kind in ("shares", "device"):
        lookup = slot_formats.get if slot_formats is not None else slot_format_get
        parts.append(lookup(slot_name=request.slot, subtype=request.kind).format_amount(request.amount))
    parts.append(f"{request.cpu} core" + ("s" if request.cpu != 1 else ""))
    parts.append(format_binary_size(request.mem))
    return " · ".join(parts)


def session_configuration(session: ComputeSession) -> str:
    """What the session asked for, formatted (see request_configuration); for MIG requests and
    isolation "any" also what it got and why (`session_grant_text`)."""
    return configuration_text(session_configuration_parts(session))


def configuration_text(parts: dict) -> str:
    """`session_configuration_parts`' answer as one line: the request, then " — " and the grant."""
    return parts["requested"] + (f" — {parts['grant']}" if parts["grant"] else "")


def session_configuration_parts(session: ComputeSession, *, slot_formats: SlotFormats | None = None) -> dict:
    """`{"requested": "MIG instance of at least 15 GiB · 1 core · 1 GiB", "grant": "got MIG
    1g.20gb on GPU 0 (memory slices 6–7): the smallest MIG instance that holds 15 GiB",
    "mig_profile": "1g.20gb"}`: the request formatted, what a MIG or isolation-"any" session
    got and why ("" for others and while not placed) and the MIG profile it got ("" for a
    shared slice). No query for a session from `session_list_for` given the page's
    `slot_formats` (see request_configuration)."""
    request = session_request(session)
    grant, profile = session_grant(session, request)
    return {"requested": request_configuration(request, slot_formats=slot_formats), "grant": grant, "mig_profile": profile}


# --- what a MIG session got --------------------------------------------------------------------


def wants_mig(request) -> TypeGuard[MigResourceRequest]:
    return isinstance(request, MigResourceRequest)


def session_grant_text(session: ComputeSession, request) -> str:
    """What a MIG or isolation-"any" session got and why, for its page: "got MIG 1g.20gb on GPU
    0 (memory slices 6–7): the smallest MIG instance that holds 15 GiB". Empty for other
    requests and for sessions not placed yet."""
    return session_grant(session, request)[0]


def session_grant(session: ComputeSession, request) -> tuple[str, str]:
    """(`session_grant_text`, the MIG profile the session got: "1g.20gb", a static slice's
    "10g", or "" for a shared slice, for other requests and while not placed). No query for a
    session from `sessions.selectors.sessions_shown`, which reads its GPU instances and
    allocations with it."""
    if not wants_mig(request) or session.node_id is None:
        return "", ""
    instance = session_gpu_instance(session)
    asked = (
        "the profile asked for"
        if request.mig_profile
        else f"the smallest MIG instance that holds {request.memory.describe() if request.memory else 'it'}"
    )
    if request.isolation == "any":
        asked = f"MIG first, for its hardware isolation; {asked}"
    if instance is not None:
        last = instance.placement_start + instance.placement_size - 1
        return (
            f"got MIG {instance.profile} on GPU {instance.parent.index} (memory slices "
            f"{instance.placement_start}–{last}): {asked}",
            instance.profile,
        )
    allocation = next(iter(session_allocations(session)), None)
    if allocation is None:
        return "", ""
    device = allocation.device
    if device.is_mig_device:
        name = device.mig_profile or device.model_name
        return f"got the MIG slice {name} of GPU {device.index}: {asked}", name
    if allocation.shares == 0 and session.node is not None and session.node.mig_mode != MigMode.OFF:
        return f"got a MIG instance on GPU {device.index} (since reused by another session): {asked}", ""
    return f"got a shared slice of GPU {device.index}: no MIG instance could hold it when it was placed", ""


LOG_READ_MAX_CHARS = 1024 * 1024  # the most characters one read returns
LOG_LOST_AGENT_GRACE_S = 30  # an ended session whose agent never sent its last batch is complete after this


def session_log_read(*, session: ComputeSession, since: int = 0, limit: int = LOG_READ_MAX_CHARS) -> dict:
    """The session's output from character offset `since`, at most `limit` characters:
    `{"text", "start", "next", "length", "truncated", "complete"}`.

    `start` is the offset of the first character returned (later than `since` when the
    output there was dropped by the size cap: then `truncated` is true), `next` the offset to
    ask for next, `length` the offset just past the last character received so far.
    `complete` is true when the session has ended and `next` is the end of its output: the
    agent sent its last batch, or the session never ran, or it ended more than
    LOG_LOST_AGENT_GRACE_S seconds ago (its agent was lost). Batches are returned in sequence
    order and only while their numbers run on, so a batch still in flight is never skipped."""
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    from sessions.models import FINAL_STATUSES, SessionLog, SessionLogChunk

    row = SessionLog.objects.filter(session=session).first()
    length = row.length if row else 0
    kept = SessionLogChunk.objects.filter(session=session)
    first_kept = kept.order_by("seq").values_list("seq", "offset").first()
    parts: list[str] = []
    start = position = since
    taken, expected_seq = 0, None
    for chunk in kept.filter(end__gt=since).order_by("seq").iterator(chunk_size=64):
        if expected_seq is None and chunk.offset > since:
            # Starting past `since` is right only when what lies between is gone (dropped by a
            # size cap) rather than in flight: the batch before this one is here, or this is
            # the first batch, or the first one kept after trimming.
            trimmed = first_kept is not None and chunk.seq == first_kept[0] and length > settings.FGPU_SESSION_LOG_MAX_CHARS
            if not (chunk.seq == 0 or trimmed or kept.filter(seq=chunk.seq - 1).exists()):
                break
        elif expected_seq is not None and chunk.seq != expected_seq:
            break  # a batch still in flight: stop before it
        if position < chunk.offset:
            position = chunk.offset
        if expected_seq is None:
            start = position
        text = chunk.text[position - chunk.offset :]
        piece = text[: limit - taken]
        parts.append(piece)
        taken += len(piece)
        position += len(piece)
        expected_seq = chunk.seq + 1
        if len(piece) < len(text):
            break
    ended = session.status in FINAL_STATUSES
    all_in = (
        bool(row and row.complete)
        or session.started_at is None
        or (
            session.terminated_at is not None
            and session.terminated_at < timezone.now() - timedelta(seconds=LOG_LOST_AGENT_GRACE_S)
        )
    )
    truncated = first_kept is not None and since < first_kept[1] and length > settings.FGPU_SESSION_LOG_MAX_CHARS
    return {
        "text": "".join(parts),
        "start": start,
        "next": position,
        "length": length,
        "truncated": truncated,
        "complete": ended and all_in and position >= length,
    }
