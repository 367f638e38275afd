"""The authentication backend: Django's ModelBackend behind the login throttle."""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from accounts import throttle


class ThrottledModelBackend(ModelBackend):
    """ModelBackend that refuses every login for a username or from an address that has too
    many recent failures (accounts.throttle), whoever asks: the admin's login page included.
    Raising PermissionDenied makes authenticate() stop and return None. A successful login
    clears the username's failures."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if throttle.login_blocked_for(username=username, ip=throttle.client_ip(request)):
            raise PermissionDenied("too many failed logins")
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None:
            throttle.login_failures_clear(username=username)
        return user
