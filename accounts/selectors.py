"""Reads of API tokens (always through the permission-checking fetch helpers) and of the caller."""

from __future__ import annotations

import hashlib
from typing import cast

from django.core.exceptions import ValidationError
from django.http import Http404
from rest_framework.authtoken.models import Token

from accounts.models import ApiToken


def api_token_digest(key: str) -> str:
    """SHA-256 of the key, hex (what ApiToken.digest stores)."""
    return hashlib.sha256(key.encode()).hexdigest()


def api_token_list_for(*, user):
    """`user`'s live (not revoked) tokens, newest first. Personal: staff see only their own here."""
    return ApiToken.objects.filter(user=user, revoked_at__isnull=True).order_by("-created_at")


def api_token_get_for(*, user, token_id) -> ApiToken:
    """`user`'s own live token. Raises Http404 for anyone else's, a revoked one or a bad id
    (404, never 403, as for sessions)."""
    try:
        return api_token_list_for(user=user).get(pk=token_id)
    except (ApiToken.DoesNotExist, ValidationError, ValueError, TypeError):
        raise Http404("no such token") from None


# DRF authtoken keys are 40 hex digits (Token.key holds no more); a named token's key is 43
# characters (accounts.services.api_token_create), so the length tells which table to look in.
LOGIN_TOKEN_KEY_LENGTH = cast(int, Token._meta.get_field("key").max_length)  # a CharField's: always set


def api_token_find(*, key: str) -> ApiToken | None:
    """The ApiToken (revoked or not, with its user) whose key this is; None when no ApiToken has
    it (it may still be a key from DRF's authtoken, see accounts.authentication). A key no
    longer than a DRF authtoken key (LOGIN_TOKEN_KEY_LENGTH) is no named token's: None without
    a query, so every request authenticates with one lookup."""
    if len(key) <= LOGIN_TOKEN_KEY_LENGTH:
        return None
    return ApiToken.objects.select_related("user").filter(digest=api_token_digest(key)).first()


def login_token_get_for(*, user) -> Token | None:
    """The token `POST /api/v1/auth/token/` hands out for `user`'s password (`fgpu login` stores
    it), or None when none was issued yet."""
    return Token.objects.filter(user=user).first()


def user_summary(*, user) -> dict:
    """`{"username", "is_admin", "projects", "live_sessions", "quota_headroom"}` for `user`:
    `is_admin` is `is_staff`; `live_sessions` counts sessions PENDING or active;
    `quota_headroom` is sessions.quotas.quota_headroom as quota figures (fGPU as text, None:
    unlimited)."""
    from sessions.models import ACTIVE_STATUSES, SessionStatus
    from sessions.quotas import quota_figures, quota_headroom

    return {
        "username": user.get_username(),
        "is_admin": bool(user.is_staff),
        "projects": sorted(user.projects.values_list("name", flat=True)),
        "live_sessions": user.compute_sessions.filter(status__in=[SessionStatus.PENDING, *ACTIVE_STATUSES]).count(),
        "quota_headroom": quota_figures(**quota_headroom(user=user)),
    }
