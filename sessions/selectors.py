"""Reads of compute sessions, always through the permission-checking fetch helpers."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import Http404

from accelerators.allocation import core
from accelerators.allocation.requests import describe_request, request_from_spec
from accelerators.allocation.units import format_binary_size
from accelerators.selectors import slot_format_get
from sessions.models import ComputeSession


def session_list_for(*, user):
    """Sessions `user` may see: all for staff, their own otherwise; newest first."""
    sessions = ComputeSession.objects.select_related("owner", "node").prefetch_related("allocations__device")
    return sessions if user.is_staff else sessions.filter(owner=user)


def session_get_for(*, user, session_id) -> ComputeSession:
    """The session if `user` owns it or is staff. Raises Http404 otherwise, so ids of other
    users' sessions do not leak (404, never 403)."""
    try:
        return session_list_for(user=user).get(pk=session_id)
    except (ComputeSession.DoesNotExist, ValidationError, ValueError, TypeError):
        raise Http404("no such session") from None


def session_request(session: ComputeSession) -> core.ResourceRequest:
    """The session's normalised request (sessions created before request_spec existed are
    rebuilt from their columns)."""
    if session.request_spec:
        return request_from_spec(session.request_spec)
    kind = session.slot_subtype if session.slot_name else "none"
    return core.ResourceRequest(kind=kind, amount=session.amount, cpu=session.cpu, mem=session.mem, slot=session.slot_name)


def request_configuration(request: core.ResourceRequest) -> str:
    """A request formatted by the slot formats: "0.50 fGPU · 1 core · 1 GiB", or for per-device
    styles "2 GPU × 4 GiB, 60% cores · 1 core · 1 GiB"."""
    parts = []
    if request.kind == "per_device":
        parts.append(describe_request(request))
    elif request.kind in ("shares", "device"):
        parts.append(slot_format_get(slot_name=request.slot, subtype=request.kind).format_amount(request.amount))
    parts.append(f"{request.cpu} core" + ("s" if request.cpu != 1 else ""))
    parts.append(format_binary_size(request.mem))
    return " · ".join(parts)


def session_configuration(session: ComputeSession) -> str:
    """What the session asked for, formatted (see request_configuration)."""
    return request_configuration(session_request(session))
