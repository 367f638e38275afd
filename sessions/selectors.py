"""Reads of compute sessions, always through the permission-checking fetch helpers."""
from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.http import Http404

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


def session_configuration(session: ComputeSession) -> str:
    """What the session asked for, formatted by the slot formats: "0.50 fGPU · 1 core · 1 GiB"."""
    parts = []
    if session.slot_subtype == "per_device":
        parts.append(describe_request(request_from_spec(session.request_spec)))
    elif session.slot_name:
        fmt = slot_format_get(slot_name=session.slot_name, subtype=session.slot_subtype)
        parts.append(fmt.format_amount(Decimal(session.amount)))
    parts.append(f"{session.cpu} core" + ("s" if session.cpu != 1 else ""))
    parts.append(format_binary_size(session.mem))
    return " · ".join(parts)
