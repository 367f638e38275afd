"""Reads of API tokens (always through the permission-checking fetch helpers) and of the caller."""

from __future__ import annotations

import hashlib
from django.core.exceptions import ValidationError
from django.http import Http404
from accounts.models import ApiToken, LoginToken, TokenKind


def api_token_digest(key: str) -> str:
    """SHA-256 of the key, hex (what ApiToken.digest stores)."""
    return hashlib.sha256(key.encode()).hexdigest()


def api_token_list_for(*, user):
    """`user`'s live (not revoked) named tokens, newest first. Personal: staff see only their own
    here. Login tokens are not listed (login_token_get_for)."""
    return ApiToken.objects.filter(user=user, kind=TokenKind.NAMED, revoked_at__isnull=True).order_by("-created_at")


def api_token_get_for(*, user, token_id) -> ApiToken:
    """`user`'s own live token. Raises Http404 for anyone else's, a revoked one or a bad id
    (404, never 403, as for sessions)."""
    try:
        return api_token_list_for(user=user).get(pk=token_id)
    except (ApiToken.DoesNotExist, ValidationError, ValueError, TypeError):
        raise Http404("no such token") from None


def api_token_find(*, key: str) -> ApiToken | None:
    """The token (named or login, revoked or not, with its user) whose key this is, found by the
    SHA-256 digest of `key` (one indexed lookup: the key itself is stored nowhere, so nothing
    compares it; the digest equality is the database's); None when no token has it."""
    if not key or len(key) > 256:
        return None
    return ApiToken.objects.select_related("user").filter(digest=api_token_digest(key)).first()


def login_token_get_for(*, user) -> LoginToken | None:
    """The newest live token `POST /api/v1/auth/token/` issued for `user`'s password (`fgpu
    login` stores it), or None when there is none."""
    return LoginToken.objects.filter(user=user, revoked_at__isnull=True).order_by("-created_at").first()


def user_summary(*, user) -> dict:
    """`{"username", "is_admin", "projects", "live_sessions", "quota_headroom"}` for `user`:
    `is_admin` is `is_staff`; `live_sessions` counts sessions PENDING or active;
    `quota_headroom` is sessions.policy.quotas.quota_headroom as quota figures (fGPU as text, None:
    unlimited)."""
    from sessions.models import ACTIVE_STATUSES, SessionStatus
    from sessions.policy.quotas import quota_figures, quota_headroom

    return {
        "username": user.get_username(),
        "is_admin": bool(user.is_staff),
        "projects": sorted(user.projects.values_list("name", flat=True)),
        "live_sessions": user.compute_sessions.filter(status__in=[SessionStatus.PENDING, *ACTIVE_STATUSES]).count(),
        "quota_headroom": quota_figures(**quota_headroom(user=user)),
    }
