"""Session apps on an origin of their own (issue 31.4): which requests are the apps origin's,
the one-time tickets that carry a console sign-in over to it, and the app-origin cookie.

- The apps origin is `settings.FGPU_APPS_ORIGIN` ("scheme://host[:port]"; "" = apps are off). A
  request is the apps origin's when its `Host` header, as host[:port] with the scheme's default
  port filled in, is that origin's (`is_apps_request`); every other request is the console's. One
  web process may serve both (the same uvicorn; standalone binds a second port for it).
- Ticket: random (32 bytes, URL-safe), single use, FGPU_APP_TICKET_TTL seconds (30), kept in
  Django's cache (Redis in the distributed stack, so any web process redeems what another issued;
  memory in standalone's one process), bound to a user, a session, an app and the path to open.
  The console issues one when a signed-in user asks for an app's path on the console's origin
  (`app_ticket_issue`) and redirects to `<apps origin>/_fgpu/app-login?ticket=…`; the apps origin
  redeems it (`app_ticket_redeem`: gone once read) into a grant.
- Grant: the value of the app-origin cookie FGPU_APPS_COOKIE ("fgpu_app": HttpOnly, SameSite=Lax,
  Secure on an https apps origin, Path=/sessions/<id>/apps/<name>/), random like a ticket, kept in
  the cache for FGPU_APP_COOKIE_AGE seconds, bound to the user, session and app of its ticket. It
  names a user, nothing more: the proxy checks on every request that this user (still active) may
  see the session (its owner or an administrator) and that the session runs.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit

from django.conf import settings
from django.core.cache import cache

LOGIN_PATH = "/_fgpu/app-login"
TICKET_KEY = "fgpu-app-ticket:{}"
GRANT_KEY = "fgpu-app-grant:{}"
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def apps_origin() -> str:
    """The apps origin, "scheme://host[:port]" without a trailing slash; "" when apps are off."""
    return settings.FGPU_APPS_ORIGIN


def apps_secure() -> bool:
    """Whether the apps origin is served over TLS (its cookie is then Secure)."""
    return apps_origin().startswith("https://")


def host_key(host: str, *, scheme: str) -> str:
    """`host` ("name", "name:port", "[v6]:port"), lower-cased, with `scheme`'s default port filled
    in: "apps.example.org" (https) → "apps.example.org:443"."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host.partition("]")
        name += "]"
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, port = host.split(":")
    else:
        name, port = host, ""
    return f"{name}:{port or DEFAULT_PORTS.get(scheme, 80)}"


def origin_key(origin: str) -> str:
    """An origin ("scheme://host[:port]") as `host_key` puts it; "" for an empty or opaque one."""
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return ""
    return host_key(parts.netloc, scheme=parts.scheme)


def header(scope, name: bytes) -> str | None:
    """The first request header `name` (lower-case bytes) of an ASGI scope, as text."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def is_apps_request(scope) -> bool:
    """Whether an ASGI request (HTTP or websocket) is addressed to the apps origin (its `Host`)."""
    origin = apps_origin()
    if not origin:
        return False
    host = header(scope, b"host")
    if host is None:
        return False
    return host_key(host, scheme=urlsplit(origin).scheme) == origin_key(origin)


def from_apps_origin(scope) -> bool:
    """Whether a request to the console carries the apps origin in its `Origin` header: a page a
    session's app served, calling the console (refused: the console answers only its own pages)."""
    origin = apps_origin()
    sent = header(scope, b"origin")
    return bool(origin and sent and origin_key(sent) == origin_key(origin))


def cookie_values(scope, name: str) -> list[str]:
    """Every value of cookie `name` the request carries (a browser sends one per matching path,
    the most specific first)."""
    found = []
    for key, value in scope.get("headers", []):
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                cookie, _, text = part.strip().partition("=")
                if cookie == name and text:
                    found.append(text)
    return found


def app_ticket_issue(*, user_id: int, auth: str, session_id: str, app: str, path: str, console: str) -> str:
    """A new ticket for `user_id` to open `path` (under "/sessions/<session_id>/apps/<app>/", with
    its query) on the apps origin; `auth`: the user's session auth hash now (Django's, from the
    password hash: a changed password ends the grants it led to); `console`: the console's origin
    the ticket was issued on (the app origin's pages link back to it). Returns the ticket (43
    URL-safe characters)."""
    ticket = secrets.token_urlsafe(32)
    record = {"user": user_id, "auth": auth, "session": str(session_id), "app": app, "path": path, "console": console}
    cache.set(TICKET_KEY.format(ticket), record, settings.FGPU_APP_TICKET_TTL)
    return ticket


def app_ticket_redeem(ticket: str) -> dict | None:
    """The ticket's record `{"user", "auth", "session", "app", "path", "console"}`, and the ticket gone:
    of two redeemers at once, one gets it. None for an unknown, used or expired ticket."""
    if not ticket or len(ticket) > 64:
        return None
    key = TICKET_KEY.format(ticket)
    record = cache.get(key)
    if record is None or not cache.delete(key):  # delete is true for the one caller that removed it
        return None
    return record


def app_grant_issue(record: dict) -> str:
    """A new grant (the app-origin cookie's value) for a redeemed ticket's user, session and app."""
    grant = secrets.token_urlsafe(32)
    value = {key: record[key] for key in ("user", "auth", "session", "app", "console")}
    cache.set(GRANT_KEY.format(grant), value, settings.FGPU_APP_COOKIE_AGE)
    return grant


def app_grant_find(values: list[str], *, session_id: str, app: str) -> dict | None:
    """The grant among the cookie values `values` made for `session_id`'s `app`: `{"user", "auth",
    "session", "app", "console"}`; None when there is none."""
    for value in values[:16]:
        if len(value) > 64:
            continue
        grant = cache.get(GRANT_KEY.format(value))
        if grant is not None and grant["session"] == str(session_id) and grant["app"] == app:
            return grant
    return None


def app_cookie(grant: str, *, session_id: str, app: str) -> bytes:
    """The Set-Cookie header value that gives the browser `grant` on the apps origin."""
    parts = [
        f"{settings.FGPU_APPS_COOKIE}={grant}",
        f"Path=/sessions/{session_id}/apps/{app}/",
        f"Max-Age={settings.FGPU_APP_COOKIE_AGE}",
        "HttpOnly",
        "SameSite=Lax",
    ]
    if apps_secure():
        parts.append("Secure")
    return "; ".join(parts).encode("latin-1")
