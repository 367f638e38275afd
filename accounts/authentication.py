"""`Authorization: Token <key>` for the REST API: named API tokens first, then DRF authtoken keys.

The keys `POST /api/v1/auth/token/` hands out (DRF's `authtoken`, what `fgpu login` stores) keep
working unchanged; a key that is neither is refused with 401, as is a revoked API token.
"""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from accounts.selectors import api_token_find
from accounts.services import api_token_touch


class ApiTokenAuthentication(TokenAuthentication):
    """DRF authentication class: `Token <key>` → `(user, ApiToken)` for a named API token, or
    `(user, authtoken.Token)` for a DRF authtoken key. Raises AuthenticationFailed (401, with
    `WWW-Authenticate: Token`) for a revoked token, an unknown key or an inactive user."""

    def authenticate_credentials(self, key):
        token = api_token_find(key=key)
        if token is None:
            return super().authenticate_credentials(key)  # DRF authtoken: unknown keys fail there
        if token.is_revoked:
            raise exceptions.AuthenticationFailed("This token was revoked.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        api_token_touch(token=token)
        return token.user, token
