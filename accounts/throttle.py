"""Login throttling, per (username, address) with a ceiling per address:

- after LIMIT failed logins for one username from one client address within WINDOW seconds,
  logins for that username from that address are refused until the window ends ("Too many
  attempts, try again in N minutes"); the same username from another address is not affected,
  nor are other usernames from that address (five bad passwords for a user that does not exist
  once locked every user behind a shared address out);
- after ADDRESS_LIMIT failures from one address, whatever the usernames, every login from it is
  refused for the rest of the window (a guesser walking through usernames).

Failures are counted by the `user_login_failed` signal, so every authenticate() call counts (the
login page, `POST /api/v1/auth/token/`, the admin's login); the login page and the token endpoint
check before authenticating and answer 429, and accounts.backends refuses any other caller.

Counters live in Django's default cache: Redis when REDIS_URL is set, so every web process shares
them; process memory otherwise (standalone: one process). The window is fixed, starting at the
first failure; a successful login clears its (username, address) count, never the address's (or
an attacker could reset it with an account of their own). An administrator clears a user's
locks (the Users admin's "Clear failed logins" action, or `manage.py login_unlock --user NAME`)
and an address's (`manage.py login_unlock --address IP`). The address is REMOTE_ADDR: behind a
reverse proxy, uvicorn takes it from X-Forwarded-For only from `--forwarded-allow-ips` (default
127.0.0.1): list the proxy's address there, or every user shares the proxy's address.
"""

from __future__ import annotations

import hashlib
import math
import time

from django.core.cache import cache

LIMIT = 5  # failed logins for one username from one address
ADDRESS_LIMIT = 50  # failed logins from one address, any usernames
WINDOW = 15 * 60  # seconds
_PREFIX = "fgpu:login-failures"


def _clock() -> float:
    """Now, in seconds since the epoch (tests move it)."""
    return time.time()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _user(username: str) -> str:
    return _digest(str(username).strip().lower())


def _generation(username: str) -> int:
    """Bumped by `login_failures_clear_user`: every (username, address) count of the username
    starts again (the cache cannot list them)."""
    return cache.get(f"{_PREFIX}:generation:{_user(username)}") or 0


def _subjects(*, username: str | None, ip: str | None) -> list[tuple[str, int]]:
    """(cache key prefix, limit) of each counter a login for `username` from `ip` touches."""
    subjects = []
    if username and ip:
        subjects.append((f"{_PREFIX}:pair:{_user(username)}:{_generation(username)}:{_digest(ip)}", LIMIT))
    if ip:
        subjects.append((f"{_PREFIX}:ip:{_digest(ip)}", ADDRESS_LIMIT))
    return subjects


def client_ip(request) -> str | None:
    """The client's address as the server saw it (REMOTE_ADDR), or None without a request."""
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def login_blocked_for(*, username: str | None, ip: str | None) -> int:
    """Seconds until a login for `username` from `ip` may be tried again; 0 when it may now."""
    now = _clock()
    wait = 0.0
    for subject, limit in _subjects(username=username, ip=ip):
        state = cache.get_many([subject + ":start", subject + ":count"])
        start, count = state.get(subject + ":start"), state.get(subject + ":count") or 0
        if start is not None and now < start + WINDOW and count >= limit:
            wait = max(wait, start + WINDOW - now)
    return math.ceil(wait)


def login_failure_record(*, username: str | None, ip: str | None) -> None:
    """Count one failed login against (`username`, `ip`) and against `ip`."""
    now = _clock()
    for subject, _ in _subjects(username=username, ip=ip):
        start = cache.get(subject + ":start")
        if start is None or now >= start + WINDOW:  # no window yet, or the last one is over
            cache.set_many({subject + ":start": now, subject + ":count": 1}, timeout=WINDOW)
            continue
        try:
            cache.incr(subject + ":count")  # atomic, in Redis as in process memory
        except ValueError:  # the count expired before the start did
            cache.set(subject + ":count", 1, timeout=max(1, math.ceil(start + WINDOW - now)))


def login_failures_clear(*, username: str | None, ip: str | None) -> None:
    """Forget the failed logins of `username` from `ip` (after a successful one); the
    address's own count stays."""
    if username and ip:
        subject = _subjects(username=username, ip=ip)[0][0]
        cache.delete_many([subject + ":start", subject + ":count"])


def login_failures_clear_user(*, username: str) -> None:
    """An administrator's unlock: forget `username`'s failed logins from every address."""
    key = f"{_PREFIX}:generation:{_user(username)}"
    cache.set(key, _generation(username) + 1, timeout=None)


def login_failures_clear_address(*, ip: str) -> None:
    """An administrator's unlock: forget the failed logins counted against address `ip`
    (its (username, address) counts stay; clear the user for those)."""
    subject = f"{_PREFIX}:ip:{_digest(ip)}"
    cache.delete_many([subject + ":start", subject + ":count"])


def wait_message(seconds: int) -> str:
    """ "Too many attempts, try again in 15 minutes." (whole minutes, rounded up)."""
    minutes = max(1, math.ceil(seconds / 60))
    return f"Too many attempts, try again in {minutes} minute{'s' if minutes != 1 else ''}."


def on_login_failed(sender, credentials, request=None, **kwargs) -> None:
    """`user_login_failed` receiver: counts the failure against the username and the address."""
    from django.contrib.auth import get_user_model

    username = credentials.get(get_user_model().USERNAME_FIELD) or credentials.get("username")
    login_failure_record(username=username, ip=client_ip(request))
