"""The authentication backend: Django's ModelBackend behind the login throttle."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from accounts import throttle


class ThrottledModelBackend(ModelBackend):
    """ModelBackend that refuses a login for a username from an address, or any login from an
    address, with too many recent failures (accounts.throttle), whoever asks: the admin's login
    page included. Raising PermissionDenied makes authenticate() stop and return None. A
    successful login clears the failures of its username from its address."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        ip = throttle.client_ip(request)
        if throttle.login_blocked_for(username=username, ip=ip):
            raise PermissionDenied("too many failed logins")
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None:
            throttle.login_failures_clear(username=username, ip=ip)
        return user
