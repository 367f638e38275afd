"""`Authorization: Token <key>` for the REST API: named API tokens and login tokens (`POST
/api/v1/auth/token/`, what `fgpu login` stores), both stored as SHA-256 digests and found by the
digest of the key presented (accounts.selectors.api_token_find). An unknown key, a revoked token
or an inactive user is refused with 401.
"""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from accounts.selectors import api_token_find
from accounts.services import api_token_touch


class ApiTokenAuthentication(TokenAuthentication):
    """DRF authentication class: `Token <key>` → `(user, ApiToken)` (a named token or a login
    token: `token.kind`). Raises AuthenticationFailed (401, with `WWW-Authenticate: Token`) for
    an unknown key, a revoked token or an inactive user."""

    def authenticate_credentials(self, key):
        token = api_token_find(key=key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if token.is_revoked:
            raise exceptions.AuthenticationFailed("This token was revoked.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        api_token_touch(token=token)
        return token.user, token
