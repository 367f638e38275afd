"""Login throttling: after LIMIT failed logins for one username, or from one client address,
within WINDOW seconds, every login for that username or from that address is refused until the
window ends ("Too many attempts, try again in N minutes").

Failures are counted by the `user_login_failed` signal, so every authenticate() call counts (the
login page, `POST /api/v1/auth/token/`, the admin's login); the login page and the token endpoint
check before authenticating and answer 429, and accounts.backends refuses any other caller.

Counters live in Django's default cache: Redis when REDIS_URL is set, so every web process shares
them; process memory otherwise (standalone: one process). The window is fixed, starting at the
first failure; a successful login clears the username's count, never the address's (or an
attacker could reset it with an account of their own). The address is REMOTE_ADDR: behind a
reverse proxy run daphne with `--proxy-headers`, or every user shares the proxy's address.
"""
from __future__ import annotations

import hashlib
import math
import time

from django.core.cache import cache

LIMIT = 5  # failed logins
WINDOW = 15 * 60  # seconds
_PREFIX = "fgpu:login-failures"


def _clock() -> float:
    """Now, in seconds since the epoch (tests move it)."""
    return time.time()


def _subjects(*, username: str | None, ip: str | None) -> list[str]:
    subjects = []
    if username:
        subjects.append("user:" + hashlib.sha256(str(username).strip().lower().encode()).hexdigest())
    if ip:
        subjects.append("ip:" + hashlib.sha256(ip.encode()).hexdigest())
    return [f"{_PREFIX}:{subject}" for subject in subjects]


def client_ip(request) -> str | None:
    """The client's address as the server saw it (REMOTE_ADDR), or None without a request."""
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def login_blocked_for(*, username: str | None, ip: str | None) -> int:
    """Seconds until a login for `username` from `ip` may be tried again; 0 when it may now."""
    now = _clock()
    wait = 0.0
    for subject in _subjects(username=username, ip=ip):
        state = cache.get_many([subject + ":start", subject + ":count"])
        start, count = state.get(subject + ":start"), state.get(subject + ":count") or 0
        if start is not None and now < start + WINDOW and count >= LIMIT:
            wait = max(wait, start + WINDOW - now)
    return math.ceil(wait)


def login_failure_record(*, username: str | None, ip: str | None) -> None:
    """Count one failed login against `username` and against `ip`."""
    now = _clock()
    for subject in _subjects(username=username, ip=ip):
        start = cache.get(subject + ":start")
        if start is None or now >= start + WINDOW:  # no window yet, or the last one is over
            cache.set_many({subject + ":start": now, subject + ":count": 1}, timeout=WINDOW)
            continue
        try:
            cache.incr(subject + ":count")  # atomic, in Redis as in process memory
        except ValueError:  # the count expired before the start did
            cache.set(subject + ":count", 1, timeout=max(1, math.ceil(start + WINDOW - now)))


def login_failures_clear(*, username: str | None) -> None:
    """Forget `username`'s failed logins (after a successful one); the address's stay."""
    for subject in _subjects(username=username, ip=None):
        cache.delete_many([subject + ":start", subject + ":count"])


def wait_message(seconds: int) -> str:
    """"Too many attempts, try again in 15 minutes." (whole minutes, rounded up)."""
    minutes = max(1, math.ceil(seconds / 60))
    return f"Too many attempts, try again in {minutes} minute{'s' if minutes != 1 else ''}."


def on_login_failed(sender, credentials, request=None, **kwargs) -> None:
    """`user_login_failed` receiver: counts the failure against the username and the address."""
    from django.contrib.auth import get_user_model

    username = credentials.get(get_user_model().USERNAME_FIELD) or credentials.get("username")
    login_failure_record(username=username, ip=client_ip(request))
