"""API tokens, stored as digests: the named ones users create and revoke on their profile page,
and the login tokens `POST /api/v1/auth/token/` issues for a password (`fgpu login`), which are
rows of the same table (`kind` "login") shown through a proxy."""

from __future__ import annotations

import uuid
from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q


class TokenKind(models.TextChoices):
    NAMED = "named", "named API token"
    LOGIN = "login", "login token (fgpu login)"


class ApiToken(models.Model):
    """A credential for `Authorization: Token <key>` on `/api/v1/`, acting as `user`: a named API
    token (`kind` "named") or a login token issued for the user's password (`kind` "login").

    Only the SHA-256 digest of the key is stored (hex, 64 characters); the key itself is shown
    once, when the token is created. `prefix` is the key's first 8 characters, so a user can tell
    their tokens apart. A revoked token (`revoked_at` set) authenticates nothing and is kept for
    the record. `last_used_at` is updated at most once a minute.
    """

    PREFIX_LENGTH = 8

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=64)
    kind = models.CharField(max_length=8, choices=TokenKind.choices, default=TokenKind.NAMED, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=PREFIX_LENGTH, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at"]
        constraints = [
            # A name picks out one live named token; a revoked token's name may be used again.
            models.UniqueConstraint(
                fields=["user", "name"],
                condition=Q(revoked_at__isnull=True, kind="named"),
                name="accounts_apitoken_unique_live_name",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class LoginTokenManager(models.Manager):
    def get_queryset(self):
        return super().get_queryset().filter(kind=TokenKind.LOGIN)


class LoginToken(ApiToken):
    """The tokens `POST /api/v1/auth/token/` issues for a password (what `fgpu login` stores):
    ApiToken rows of kind "login", shown in the admin beside the named API tokens. A proxy: no
    table of its own; its manager sees login tokens only."""

    objects: ClassVar[LoginTokenManager] = LoginTokenManager()  # login tokens only

    class Meta:
        proxy = True
        verbose_name = "login token (fgpu login)"
        verbose_name_plural = "login tokens (fgpu login)"

    def __str__(self) -> str:
        return f"{self.user} ({self.prefix}…)"
