"""Writes to API tokens: create, revoke, record use; login tokens: issue, revoke."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import cast

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiToken, LoginToken, TokenKind
from accounts.selectors import api_token_digest
from common.errors import ApplicationError

LAST_USED_RESOLUTION = timedelta(minutes=1)
LOGIN_TOKENS_KEPT = 10  # a user's newest login tokens that stay valid (one per machine that ran fgpu login)
LOGIN_TOKEN_NAME = "fgpu login"
NAME_MAX_LENGTH = cast(int, ApiToken._meta.get_field("name").max_length)  # a CharField's: always set


def api_token_create(*, user, name: str) -> tuple[str, ApiToken]:
    """A new live token named `name` for `user`. Returns `(key, token)`: the key (43 URL-safe
    characters, 256 bits) exists only in this return value; the row holds its SHA-256 digest.

    Raises ApplicationError (400, field `name`) for an empty or too long name, or one that
    another of the user's live tokens already has."""
    name = (name or "").strip()
    if not name:
        raise ApplicationError("Give the token a name.", field_errors={"name": ["Give the token a name."]})
    if len(name) > NAME_MAX_LENGTH:
        detail = f"A token name has at most {NAME_MAX_LENGTH} characters."
        raise ApplicationError(detail, field_errors={"name": [detail]})
    key = secrets.token_urlsafe(32)  # 43 characters
    try:
        with transaction.atomic():
            token = ApiToken.objects.create(
                user=user, name=name, digest=api_token_digest(key), prefix=key[: ApiToken.PREFIX_LENGTH]
            )
    except IntegrityError:  # the partial unique constraint on (user, name) of live tokens
        detail = f"You already have a token named “{name}”. Revoke it or pick another name."
        raise ApplicationError(detail, type="conflict", title="Conflict", status=409, field_errors={"name": [detail]}) from None
    return key, token


def api_token_revoke(*, token: ApiToken) -> bool:
    """Revoke `token` (compare-and-set on `revoked_at`). True if this call revoked it, False if
    it already was. Its key stops authenticating at once (401)."""
    updated = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    return updated == 1


def api_token_touch(*, token: ApiToken) -> bool:
    """Record that `token` was just used, at most once per LAST_USED_RESOLUTION (one minute), so
    a busy script does not write on every request. True if `last_used_at` was written."""
    now = timezone.now()
    if token.last_used_at is not None and now - token.last_used_at < LAST_USED_RESOLUTION:
        return False
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    updated = ApiToken.objects.filter(stale, pk=token.pk).update(last_used_at=now)
    if updated:
        token.last_used_at = now
    return updated == 1


def login_token_issue(*, user) -> str:
    """A new login token for `user` (what `POST /api/v1/auth/token/` answers for a password and
    `fgpu login` stores). Returns its key (43 URL-safe characters, 256 bits), which exists only in
    this return value: the row holds its SHA-256 digest, as a named token's. Each call issues a
    new key; the user's LOGIN_TOKENS_KEPT newest login tokens stay valid, older ones are deleted
    (so `fgpu login` on one machine does not sign another out, and a script that logs in on
    every run does not pile up keys)."""
    key = secrets.token_urlsafe(32)
    with transaction.atomic():
        LoginToken.objects.create(
            user=user,
            name=LOGIN_TOKEN_NAME,
            kind=TokenKind.LOGIN,
            digest=api_token_digest(key),
            prefix=key[: ApiToken.PREFIX_LENGTH],
            last_used_at=timezone.now(),  # issued at a sign-in: used now (its first request then writes nothing)
        )
        kept = LoginToken.objects.filter(user=user).order_by("-created_at").values_list("pk", flat=True)[:LOGIN_TOKENS_KEPT]
        LoginToken.objects.filter(user=user).exclude(pk__in=list(kept)).delete()
    return key


def login_token_revoke(*, user) -> bool:
    """Delete every login token `POST /api/v1/auth/token/` issued for `user`'s password; the
    next `fgpu login` gets a new one. True if there was one."""
    deleted, _ = LoginToken.objects.filter(user=user).delete()
    return deleted > 0
