"""Named API tokens that users create and revoke on their profile page, and (a proxy) the login
tokens DRF's authtoken issues for a password."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from rest_framework.authtoken.models import Token


class ApiToken(models.Model):
    """A named credential for `Authorization: Token <key>` on `/api/v1/`, acting as `user`.

    Only the SHA-256 digest of the key is stored (hex, 64 characters); the key itself is shown
    once, when the token is created. `prefix` is the key's first 8 characters, so a user can tell
    their tokens apart. A revoked token (`revoked_at` set) authenticates nothing and is kept for
    the record. `last_used_at` is updated at most once a minute.
    """

    PREFIX_LENGTH = 8

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=64)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=PREFIX_LENGTH, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at"]
        constraints = [
            # A name picks out one live token; a revoked token's name may be used again.
            models.UniqueConstraint(
                fields=["user", "name"], condition=Q(revoked_at__isnull=True), name="accounts_apitoken_unique_live_name"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class LoginToken(Token):
    """The token `POST /api/v1/auth/token/` issues for a password (DRF authtoken; what `fgpu login`
    stores), shown in the admin beside the named API tokens: one token section, not DRF's own.
    A proxy: no table of its own."""

    class Meta:
        proxy = True
        verbose_name = "login token (fgpu login)"
        verbose_name_plural = "login tokens (fgpu login)"

    def __str__(self) -> str:
        return f"{self.user} ({self.key[:8]}…)"
