"""The console's app proxy (issue 16): `/sessions/<id>/apps/<name>/…` on the apps origin
(issue 31.4, sessions.serving.origin) forwards HTTP (streamed both ways, with httpcore) and websockets
(with `websockets`) to a web app running in the session (sessions.serving.session_apps), for the
session's owner and administrators only.

- Where: only on the apps origin (FGPU_APPS_ORIGIN), whose pages never see the console's cookies.
  The same path on the console's origin (`ConsoleAppRedirect`) answers a signed-in user with a
  one-time ticket: 302 to `<apps origin>/_fgpu/app-login?ticket=…` (`AppLogin`), which sets the
  app-origin cookie and sends the browser on to the app (without the ticket in its address).
  The apps origin serves nothing else (404), and the console refuses requests its pages send
  (`Origin` the apps origin: 403, websockets closed 4403): `OriginRouter`.
- Who: the app-origin cookie's grant, re-checked on every request, or taken as this process found
  it less than CHECK_TTL_S (1 s) before, with the app's token, unless the app was opened again
  since (`_check`): its user active and still the session's owner or an administrator, the session
  RUNNING. Without one: 401 (websockets are closed, 4401); another
  user's session or an app its image does not declare: 404, as everywhere (ids do not leak).
- What goes upstream: the request as the browser sent it, to where the session's agent says
  the app listens, with `Authorization: token <the app's token>` (random per start, set by the
  console: the user never sees it) and without the console's cookies (session, CSRF, the
  app-origin cookie) and credentials. Apps
  served under the prefix (`base_url` true, as Jupyter with `--ServerApp.base_url`) get the whole
  path; others get the rest after the prefix (and a `Location` they answer is put under it).
- The token never reaches the browser: apps that put it into their pages (JupyterLab's page
  config, so that its scripts can call its API) get it replaced in every answer, headers and body,
  and websocket text, by as many "*" (TokenMask): the scripts' calls then carry the mask, which
  the proxy replaces with the real token on the way in. Bodies are asked for uncompressed
  (`Accept-Encoding: identity`) so that the mask sees them; the length stays the same.
- Refused: a request that changes something (POST, PUT, …) from another site (403,
  `cross_site`), and a path with "." or ".." segments, or with an encoded "." "/" or "\\" (400), so no
  request reaches anything outside the app's prefix.
- A session that is not RUNNING answers a page that says it ended (410; websockets close 4410);
  an app that does not run (never opened, exited, or its port closed) a page that says so with a
  link that starts it again (502; websockets close 4502).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from importlib import import_module
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import websockets
from websockets.typing import Origin
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib import auth
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.http import Http404
from django.utils.crypto import constant_time_compare
from django.shortcuts import resolve_url
from django.template.loader import render_to_string

from common.errors import ApplicationError
from sessions.models import SessionStatus
from sessions.selectors import session_get_for
from sessions.serving.origin import (
    LOGIN_PATH,
    app_cookie,
    app_grant_find,
    app_grant_issue,
    app_ticket_issue,
    app_ticket_redeem,
    apps_origin,
    cookie_values,
    from_apps_origin,
    header,
    is_apps_request,
    origin_key,
)
from sessions.serving.relay_connect import RELAYS, RelayBackend, RelayProof, relay_socket
from sessions.serving.upstream import AsyncioBackend
from sessions.serving.session_apps import (
    OPEN_PAGE,
    TOKEN_KEY,
    app_opened,
    app_prefix,
    session_app_get,
    session_app_target,
    session_app_target_forget,
)

log = logging.getLogger(__name__)

PATH_RE = re.compile(
    r"^/sessions/(?P<session>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
    r"/apps/(?P<app>[a-z][a-z0-9-]{0,31})(?P<rest>/.*)?$"
)
ESCAPES = re.compile(rb"%(2e|2f|5c|00)|\\", re.IGNORECASE)  # encoded ".", "/", "\", NUL; a raw "\"
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "authorization",
    "cookie",
    "content-length",
}
CLOSE_UNAUTHENTICATED, CLOSE_REFUSED, CLOSE_NOT_FOUND, CLOSE_ENDED, CLOSE_APP_CLOSED = 4401, 4403, 4404, 4410, 4502
# The proxy's own pages (app_unavailable.html): no script, no framing.
PAGE_POLICY = b"default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
CONNECT_TIMEOUT_S = 10.0
WEBSOCKET_MAX_BYTES = 16 * 1024 * 1024  # the largest websocket message relayed either way (a big notebook)

if TYPE_CHECKING:  # httpcore is imported when an app is first proxied, not at the web's start (issue 33.6)
    import httpcore

# The apps' HTTP client: httpcore's connection pool, one per event loop (the web server runs one),
# without httpx's client over it: the proxy wants none of its cookie jar (which kept what one
# browser's app set and sent it with another's requests), redirects, default headers or URL
# models, which were a third of the proxy's CPU a small GET. Connections are kept (100 idle at
# most) per address, i.e. per app or per relay of a session's app, each opened with the relay's proof.
_pools: dict[int, httpcore.AsyncConnectionPool] = {}
# What httpcore asks the app's socket for at a time (bytes): at least asyncio's own recv size (its
# selector transport's max_size), so a piece asyncio read is handed on whole (and pieces waiting
# together are joined up to it: sessions.serving.upstream). httpcore's 64 KiB split each 256 KiB piece
# into four, and every piece costs both HTTP/1.1 parsers (httpcore's and uvicorn's) a pass.
READ_BYTES = 256 * 1024
# Timeouts of a request to an app (s): to connect, and to wait for a free connection; none to
# read or write, as streams may idle.
TIMEOUTS = {"connect": CONNECT_TIMEOUT_S, "pool": CONNECT_TIMEOUT_S, "read": None, "write": None}
# What the proxy keeps of a request's body to send it again (bytes): a body up to this size is sent
# again whole where a relay refused the connection's proof before a byte reached the app (`_Body`).
REPLAY_BYTES = 1024 * 1024


def _pool() -> httpcore.AsyncConnectionPool:
    import httpcore

    if httpcore.AsyncHTTP11Connection.READ_NUM_BYTES < READ_BYTES:  # class-wide: httpcore offers no setting for it
        httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = READ_BYTES
    loop = id(asyncio.get_running_loop())
    pool = _pools.get(loop)
    if pool is None:  # no proxies: apps are reached directly
        # An agent's relay takes a connection that first proves it comes from the web (protocol.app_relay);
        # the connections are asyncio's own (sessions.serving.upstream), not anyio's.
        backend: Any = RelayBackend(AsyncioBackend())  # httpcore.AsyncNetworkBackend's methods
        pool = _pools[loop] = httpcore.AsyncConnectionPool(
            max_connections=1000, max_keepalive_connections=100, network_backend=backend
        )
    return pool


def _upstream_errors() -> tuple[type[Exception], ...]:
    """httpcore's errors of a request to an app: it could not be reached, closed the connection,
    answered nonsense or timed out."""
    import httpcore

    return (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException, httpcore.UnsupportedProtocol)


def path_escapes(scope) -> bool:
    """Whether the request's path tries to leave the app's prefix: a "." or ".." segment, or an
    encoded ".", "/", "\\" or NUL anywhere in it (as sent: `raw_path`)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    raw = raw.split(b"?", 1)[0]
    if ESCAPES.search(raw):
        return True
    return any(part in (".", "..") for part in scope["path"].split("/"))


class TokenMask:
    """Replaces the app's token in a stream of bytes by as many "*", chunk by chunk, holding back
    only a tail of a chunk that could be the start of the token (so a small streamed chunk is
    passed on at once)."""

    def __init__(self, token: str) -> None:
        self.secret = token.encode()
        self.mask = b"*" * len(self.secret)
        self.carry = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.carry + chunk if self.carry else chunk  # a piece of a download is copied only where it must change
        if self.secret in data:
            data = data.replace(self.secret, self.mask)
        hold, first = 0, self.secret[:1]
        at = data.find(first, max(0, len(data) - len(self.secret) + 1))
        while at != -1:  # the longest tail that could start the token
            if self.secret.startswith(data[at:]):
                hold = len(data) - at
                break
            at = data.find(first, at + 1)
        self.carry = data[len(data) - hold :] if hold else b""
        return data[: len(data) - hold] if hold else data

    def flush(self) -> bytes:
        rest, self.carry = self.carry, b""
        return rest


def cross_site(scope) -> bool:
    """Whether an unsafe request (not GET, HEAD or OPTIONS) comes from another site: its `Origin`
    names another host than its `Host`, or the browser says `Sec-Fetch-Site: cross-site`. The proxy
    signs the request in with the app's token, which skips the app's own CSRF check (Jupyter's
    `_xsrf`), so it refuses these itself (the sign-in cookie is SameSite=Lax as well)."""
    if scope.get("method", "GET") in ("GET", "HEAD", "OPTIONS"):
        return False
    headers = {name: value.decode("latin-1") for name, value in scope.get("headers", [])}
    if headers.get(b"sec-fetch-site") == "cross-site":
        return True
    origin = headers.get(b"origin")
    if origin is None:
        return False
    return origin == "null" or origin.split("://", 1)[-1] != headers.get(b"host", "")


def _ours() -> set[str]:
    """The console's cookie names: its session, CSRF token and the app-origin cookie."""
    return {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME, settings.FGPU_APPS_COOKIE}


def _cookies_without_console(header: str) -> str:
    """The Cookie header less the console's own cookies (`_ours`)."""
    ours = _ours()
    kept = [part.strip() for part in header.split(";") if part.strip() and part.split("=", 1)[0].strip() not in ours]
    return "; ".join(kept)


def upstream_headers(scope, *, token: str) -> list[tuple[str, str]]:
    """The headers to send the app: the browser's, less hop-by-hop ones, the console's
    credentials and cookies; plus the app's token and X-Forwarded-*. The browser's `Host` is kept
    (as `X-Forwarded-Host` too): apps that compare Origin with Host (Jupyter) see the console's."""
    headers, host = [], ""
    for raw_name, raw_value in scope.get("headers", []):
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        if name == "host":
            host = value
        elif name == "cookie":
            cookies = _cookies_without_console(value)
            if cookies:
                headers.append(("cookie", cookies))
        elif name not in HOP_BY_HOP and name != "accept-encoding" and not name.startswith("sec-websocket-"):
            headers.append((name, value))
    headers += [("authorization", f"token {token}"), ("accept-encoding", "identity")]  # plain: TokenMask reads it
    if host:
        headers += [("host", host), ("x-forwarded-host", host)]
    headers.append(("x-forwarded-proto", "https" if scope.get("scheme") in ("https", "wss") else "http"))
    client = scope.get("client")
    if client:
        headers.append(("x-forwarded-for", str(client[0])))
    return headers


def _lookup(user, session_id: str, name: str) -> dict:
    """Blocking (database): the session and app the request is for, checked: `{"status",
    "app", "node"}`. Raises Http404 (not the owner nor staff, no such session or app)."""
    session = session_get_for(user=user, session_id=session_id, related=("image", "node"))
    try:
        app = session_app_get(session=session, name=name)
    except ApplicationError:
        raise Http404("no such app") from None
    return {"status": session.status, "app": app, "node": session.node.name if session.node else ""}


def _signed_in_lookup(session_key: str, session_id: str, name: str) -> dict | None:
    """Blocking (database): the console user of the sign-in cookie `session_key` (Django's
    `auth.get_user`, with its session-hash check), then `_lookup`, with the user's `user` (pk) and
    `auth` (its session auth hash); None when nobody is signed in. One trip to a worker thread
    per request, where Channels' AuthMiddlewareStack takes two more."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key or None)
    user = auth.get_user(SimpleNamespace(session=store))  # type: ignore[arg-type]  # it reads only `.session`
    if not user.is_authenticated:
        return None
    return {**_lookup(user, session_id, name), "user": user.pk, "auth": user.get_session_auth_hash()}


def _session_key(scope) -> str:
    found = cookie_values(scope, settings.SESSION_COOKIE_NAME)
    return found[0] if found else ""


def _granted_lookup(values: list[str], session_id: str, name: str) -> dict | None:
    """Blocking (cache, database): the grant among the app-origin cookie's `values` for this
    session's app, its user (active, the password unchanged since), then `_lookup` as that user,
    with the grant's `console` origin and the app's `token` (session_apps.app_token_get's, read in
    the same trip to a worker thread; None: not opened); None without a grant, or with an inactive
    user or another password. Raises Http404 as `_lookup`."""
    grant = app_grant_find(values, session_id=session_id, app=name)
    if grant is None:
        return None
    user = get_user_model().objects.filter(pk=grant["user"], is_active=True).first()
    if user is None or not constant_time_compare(grant.get("auth", ""), user.get_session_auth_hash()):
        return None  # gone, deactivated, or its password changed since
    token = cache.get(TOKEN_KEY.format(session=session_id, app=name))  # here, not in a thread hop of its own
    return {**_lookup(user, session_id, name), "console": grant["console"], "token": token}


CHECK_TTL_S = 1.0  # how long this process takes a passed check on the apps origin as it was (`_check`)
MAX_CHECKS = 10_000
# (cookie values, session, app) → (until, what `_granted_lookup` found, session_apps.app_opened before it)
_checked: dict[tuple, tuple[float, dict, int]] = {}


def _check_key(scope, match) -> tuple:
    return (tuple(cookie_values(scope, settings.FGPU_APPS_COOKIE)), match["session"], match["app"])


def _check_forget(scope, match) -> None:
    """Forget a passed check (its app did not answer): the next request is checked afresh."""
    _checked.pop(_check_key(scope, match), None)


async def _check(scope, match) -> tuple[int, dict]:
    """(0, what `_lookup` found), or (an HTTP status, page context) when the request is refused:
    on the apps origin, signed in by the app-origin cookie (`_granted_lookup`); on the console's
    (`ConsoleAppRedirect`), by the console's sign-in cookie.

    A check passed on the apps origin is taken as it was for CHECK_TTL_S (1 s) by this process for
    the same cookie, session and app, with the app's token it read, without a trip to a worker
    thread (the database's two queries and the cache's read there cost a small GET several times
    what the app does): a session ended, a user deactivated or a password changed is refused
    within that second, and at once where the app no longer answers (`_check_forget`). An app
    opened again has a new token: opened by this process (session_apps.app_opened), the kept check
    is dropped at once; by another, the app refuses the kept token and the request is checked
    afresh and sent again (`AppHttpProxy._forward`, `kept`). Refusals are never kept; the console's
    origin is checked every time. A kept check's answer says `"kept": True`."""
    try:
        if is_apps_request(scope):
            key = _check_key(scope, match)
            kept = _checked.get(key)
            opened = app_opened(session_id=match["session"], app=match["app"])
            if kept is not None and kept[0] > time.monotonic() and kept[2] == opened:
                return 0, {**kept[1], "kept": True}
            found = await database_sync_to_async(_granted_lookup)(list(key[0]), match["session"], match["app"])
            if found is not None and found["status"] == SessionStatus.RUNNING:
                _checked.pop(key, None)
                while len(_checked) >= MAX_CHECKS:  # the oldest first
                    _checked.pop(next(iter(_checked)))
                _checked[key] = (time.monotonic() + CHECK_TTL_S, found, opened)
        else:
            found = await database_sync_to_async(_signed_in_lookup)(_session_key(scope), match["session"], match["app"])
        if found is None:
            return 401, {}
    except Http404:
        return 404, {}
    if found["status"] != SessionStatus.RUNNING:
        session_app_target_forget(session_id=match["session"], name=match["app"])
        return 410, {
            "title": "Session ended",
            "why": f"The session is {found['status']}: its apps ended with it.",
            "console": found.get("console", ""),
        }
    return 0, found


def upstream_path(scope, match, app: dict, *, token: str) -> str:
    """The path and query to ask the app for (under the prefix, or the rest after it), the
    masked token (TokenMask) in the query made the real one again (`?token=…`)."""
    path = scope["path"] if app["base_url"] else (match["rest"] or "/")
    path = quote(path, safe="/:@!$&'()*+,;=-._~")
    query = scope.get("query_string", b"").decode("latin-1")
    for masked in ("*" * len(token), "%2A" * len(token), "%2a" * len(token)):
        query = query.replace(masked, token)
    return path + (f"?{query}" if query else "")


def _location(value: str, *, prefix: str, app: dict) -> str:
    """An app's redirect, put under the prefix where the app does not know it (`base_url` false)."""
    if not app["base_url"] and value.startswith("/") and not value.startswith("//"):
        return prefix.rstrip("/") + value
    return value


async def _page(send, status: int, context: dict, *, headers=()) -> None:
    body = render_to_string("sessions/app_unavailable.html", {"status": status, **context}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"cache-control", b"no-store"),
                (b"content-security-policy", PAGE_POLICY),
                (b"x-frame-options", b"DENY"),
                (b"referrer-policy", b"no-referrer"),
                (b"x-content-type-options", b"nosniff"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _not_running(session_id: str, app: dict, error: str, *, console: str | None) -> dict:
    """The 502 page's context; `console`: the console's origin its links go to (None: unknown)."""
    return {
        "title": f"{app['title']} is not running",
        "why": f"{app['title']} is not running in this session: {error}.",
        "reopen": OPEN_PAGE.format(session=session_id, app=app["name"]) if console is not None else "",
        "console": console,
    }


class AppHttpProxy:
    """ASGI application for HTTP requests under `/sessions/<id>/apps/<name>/` on the apps origin
    (signed in by the app-origin cookie: `_check`)."""

    async def __call__(self, scope, receive, send) -> None:
        match = PATH_RE.match(scope["path"])
        if match is None or path_escapes(scope):
            await _page(send, 400, {"title": "Bad path", "why": "The address tries to leave the app's place."})
            return
        if cross_site(scope):
            await _page(
                send, 403, {"title": "Refused", "why": "Another site may not send this app a request that changes something."}
            )
            return
        status, found = await _check(scope, match)
        if status == 401:
            why = "Open this app from the console's session list: it signs you in here for this app."
            await _page(send, 401, {"title": "Not signed in to this app", "why": why, "console": None})
            return
        if status:
            await _page(send, status, found or {"title": "Not found", "why": "There is no such app.", "console": None})
            return
        kept = bool(found.get("kept"))
        await self._forward(scope, receive, send, match, found["app"], console=found["console"], token=found["token"], kept=kept)

    async def _forward(
        self, scope, receive, send, match, app: dict, *, console: str, token: str | None, kept: bool = False, drained=False
    ) -> None:
        """`kept`: the check (and the token) is one this process kept (`_check`); a request without
        a body that the app refuses with it (401, 403: opened again by another web process, with a
        new token) is checked afresh and sent again with the token found then. `drained`: the
        request's body was read already (there was none)."""
        import httpcore

        session_id = match["session"]
        if token is None:
            _check_forget(scope, match)
            if not drained:
                await _drain(receive)
            await _page(send, 502, await _not_running(session_id, app, "it has not been opened", console=console))
            return
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in upstream_headers(scope, token=token)]
        sent_headers = {name for name, _ in scope.get("headers", [])}
        has_body = b"content-length" in sent_headers or b"transfer-encoding" in sent_headers
        body = _Body(receive) if has_body else None
        if not has_body and not drained:
            await _drain(receive)
        content_length = next((v for n, v in scope.get("headers", []) if n == b"content-length"), None)
        if content_length is not None:
            headers.append((b"content-length", content_length))
        elif has_body:  # the browser's chunks, sent on as chunks
            headers.append((b"transfer-encoding", b"chunked"))
        for attempt in range(2):
            target = await session_app_target(session_id=session_id, name=app["name"], port=app["port"])
            if isinstance(target, dict):
                if not await _refused_afresh(scope, match, send):
                    await _page(send, 502, await _not_running(session_id, app, target["error"], console=console))
                return
            address = f"{_host(target[0])}:{target[1]}".encode()
            path = upstream_path(scope, match, app, token=token).encode("latin-1")
            url = httpcore.URL(scheme=b"http", host=target[0].encode(), port=target[1], target=path)
            sent = headers if b"host" in sent_headers else [*headers, (b"host", address)]
            proof = RELAYS.get(target)  # the relay's proof this connection starts with (None: no relay)
            request = httpcore.Request(scope["method"], url, headers=sent, content=body, extensions={"timeout": TIMEOUTS})
            try:
                response = await _pool().handle_async_request(request)
                break
            except httpcore.ConnectError:  # it ended, or moved (an agent restarted: a new relay): ask its agent again (once)
                # Nothing of the request was sent (its body not read yet): it is sent again as it is.
                session_app_target_forget(session_id=session_id, name=app["name"])
                if attempt:
                    if await _refused_afresh(scope, match, send):
                        return
                    target = await session_app_target(session_id=session_id, name=app["name"], port=app["port"])
                    error = target["error"] if isinstance(target, dict) else "it does not accept connections"
                    await _page(send, 502, await _not_running(session_id, app, error, console=console))
                    return
            except ConnectionAbortedError:  # the browser went away during its upload
                return
            except _upstream_errors() as exc:  # it closed the connection, or answered nonsense
                log.info("app %s of session %s: %s", app["name"], session_id, exc)
                session_app_target_forget(session_id=session_id, name=app["name"])
                _check_forget(scope, match)
                replayable = body is None or body.replayable
                if not attempt and replayable and await _relay_changed(session_id, app, target, proof):
                    continue  # a relay that refused the proof under the key it had before its agent restarted: sent again
                await _page(
                    send, 502, await _not_running(session_id, app, "it closed the connection without an answer", console=console)
                )
                return
        if kept and body is None and response.status in (401, 403):
            _check_forget(scope, match)
            status, found = await _check(scope, match)
            if status or found["token"] != token:
                await response.aclose()
                if status:
                    await _page(send, status, found or {"title": "Not found", "why": "There is no such app.", "console": None})
                    return
                await self._forward(
                    scope, receive, send, match, found["app"], console=found["console"], token=found["token"], drained=True
                )
                return
        try:
            await _relay_response(
                response, receive, send, prefix=app_prefix(session_id=session_id, app=app["name"]), app=app, mask=TokenMask(token)
            )
        finally:
            await response.aclose()


async def _relay_changed(session_id: str, app: dict, target: tuple[str, int], proof: RelayProof | None) -> bool:
    """Where a connection to the agent's relay at `target`, proven with `proof`, was closed before
    any answer (the relay refuses a proof under another key before a byte reaches the app:
    protocol.app_relay): whether the agent, asked again, names another relay address or key (a
    keyless node's agent restarted with a new random key, its new relay perhaps on the old port),
    so the request may be sent again. False where it was no relay, or the agent names the same one
    (it was the app that closed the connection)."""
    if proof is None:
        return False
    session_app_target_forget(session_id=session_id, name=app["name"])
    again = await session_app_target(session_id=session_id, name=app["name"], port=app["port"])
    if isinstance(again, dict):
        return False
    return again != target or RELAYS.get(again) != proof


async def _refused_afresh(scope, match, send) -> bool:
    """Where the app did not answer: check the request again, not as kept (`_check_forget`), and
    answer the refusal's page if it is refused now (the session ended: 410); False if it passed."""
    _check_forget(scope, match)
    status, found = await _check(scope, match)
    if status:
        await _page(send, status, found or {"title": "Not found", "why": "There is no such app.", "console": None})
    return bool(status)


class _Body:
    """A request's body as the server hands it over, chunk by chunk (httpcore streams it on), its
    first REPLAY_BYTES kept: while it is no longer than that, every iteration yields it whole (the
    kept chunks, then the rest as it comes), so a request nothing of which reached the app can be
    sent again (`replayable`). Raises ConnectionAbortedError where the browser goes away."""

    def __init__(self, receive) -> None:
        self._source = _request_body(receive)
        self._kept: list[bytes] = []
        self._size = 0
        self.replayable = True

    async def __aiter__(self):
        if not self.replayable:
            raise RuntimeError("the request's body was sent already and not kept")
        for chunk in self._kept:
            yield chunk
        async for chunk in self._source:
            self._size += len(chunk)
            if self._size <= REPLAY_BYTES:
                self._kept.append(chunk)
            else:  # too large to keep: sent once
                self.replayable = False
                self._kept.clear()
            yield chunk


async def _request_body(receive):
    """The request's body as the server hands it over, chunk by chunk."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError("the browser went away while sending the request")
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body"):
            return


async def _drain(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            return


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _relay_response(response: httpcore.Response, receive, send, *, prefix: str, app: dict, mask: TokenMask) -> None:
    """Send the app's answer to the browser as it comes (its body undecoded, chunk by chunk, the
    token masked); stop reading the app when the browser goes away."""
    ours = _ours()
    headers = []
    for name, value in response.headers:
        lower = name.lower()
        if lower in (b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade"):
            continue
        if lower == b"set-cookie" and value.split(b"=", 1)[0].strip().decode("latin-1") in ours:
            continue  # an app never replaces the console's sign-in, CSRF or app-origin cookie
        if lower == b"location":
            value = _location(value.decode("latin-1"), prefix=prefix, app=app).encode("latin-1")
        headers.append((lower, value.replace(mask.secret, mask.mask)))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    gone = asyncio.create_task(_wait_disconnect(receive))
    try:
        try:
            async for chunk in response.aiter_stream():
                if gone.done():
                    return
                chunk = mask.feed(chunk)
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except _upstream_errors() as exc:  # the app went away mid-answer: end what the browser got
            log.info("an app's answer broke off: %s", exc)
        await send({"type": "http.response.body", "body": mask.flush()})
    finally:
        gone.cancel()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ConsoleAppRedirect:
    """ASGI, the console's origin, HTTP under `/sessions/<id>/apps/<name>/`: a signed-in user who
    may see the session's app (its owner or an administrator, the session RUNNING) is sent to the
    apps origin with a one-time ticket for the path asked (302); signed out: to the login page
    (302); another's session or no such app: 404; an ended session: 410; apps off (no
    FGPU_APPS_ORIGIN): 404 saying so. Only GET and HEAD (405 else): nothing is proxied here."""

    async def __call__(self, scope, receive, send) -> None:
        await _drain(receive)
        match = PATH_RE.match(scope["path"])
        if match is None or path_escapes(scope):
            await _page(send, 400, {"title": "Bad path", "why": "The address tries to leave the app's place.", "console": ""})
            return
        if not apps_origin():
            why = "Session apps are off on this console: its administrator has not set FGPU_APPS_ORIGIN (README, Session apps)."
            await _page(send, 404, {"title": "Apps are off", "why": why, "console": ""})
            return
        if scope.get("method") not in ("GET", "HEAD"):
            why = "Apps are served on their own origin; this address only leads there."
            await _page(send, 405, {"title": "Not here", "why": why, "console": ""}, headers=[(b"allow", b"GET, HEAD")])
            return
        status, found = await _check(scope, match)
        if status == 401:
            login = resolve_url(settings.LOGIN_URL) + "?next=" + quote(scope["path"])
            await _page(
                send,
                302,
                {"title": "Signed out", "why": "Sign in to open this app.", "console": ""},
                headers=[(b"location", login.encode())],
            )
            return
        if status:
            await _page(send, status, {"console": "", **(found or {"title": "Not found", "why": "There is no such app."})})
            return
        query = scope.get("query_string", b"").decode("latin-1")
        path = quote(scope["path"], safe="/:@!$&'()*+,;=-._~") + (f"?{query}" if query else "")
        ticket = await database_sync_to_async(app_ticket_issue)(
            user_id=found["user"],
            auth=found["auth"],
            session_id=match["session"],
            app=match["app"],
            path=path,
            console=_console_origin(scope),
        )
        location = f"{apps_origin()}{LOGIN_PATH}?ticket={ticket}"
        why = "Apps are served on their own origin: on your way there."
        await _page(
            send, 302, {"title": "Opening the app", "why": why, "console": ""}, headers=[(b"location", location.encode())]
        )


def _console_origin(scope) -> str:
    """The console's origin as this request reached it: "scheme://host"."""
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    if settings.FGPU_TLS or (getattr(settings, "SECURE_PROXY_SSL_HEADER", None) and _proxied_https(scope)):
        scheme = "https"
    return f"{scheme}://{header(scope, b'host') or 'localhost'}"


def _proxied_https(scope) -> bool:
    name, value = settings.SECURE_PROXY_SSL_HEADER
    wanted = name.removeprefix("HTTP_").lower().replace("_", "-").encode()
    return any(key == wanted and sent.decode("latin-1").split(",")[0].strip() == value for key, sent in scope.get("headers", []))


class AppLogin:
    """ASGI, the apps origin, `GET /_fgpu/app-login?ticket=…`: redeems the one-time ticket
    (sessions.serving.origin), sets the app-origin cookie for its session's app and redirects to the
    path the ticket was issued for (302, the ticket no longer in the address). An unknown, used or
    expired ticket: 403, and nothing set."""

    async def __call__(self, scope, receive, send) -> None:
        await _drain(receive)
        from urllib.parse import parse_qs

        ticket = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("ticket", [""])[0]
        record = await database_sync_to_async(app_ticket_redeem)(ticket)
        if record is None:
            why = "This link to an app was used already or has expired: open the app again from the console's session list."
            await _page(send, 403, {"title": "Link expired", "why": why, "console": None})
            return
        grant = await database_sync_to_async(app_grant_issue)(record)
        cookie = app_cookie(grant, session_id=record["session"], app=record["app"])
        headers = [(b"location", record["path"].encode("latin-1")), (b"set-cookie", cookie), (b"referrer-policy", b"no-referrer")]
        why = "Signed in to this app: opening it."
        await _page(send, 302, {"title": "Opening the app", "why": why, "console": record["console"]}, headers=headers)


class OriginRouter:
    """ASGI, the web's root: requests to the apps origin (`Host`: sessions.serving.origin) go to
    `apps` (HTTP: the login path and the app proxy; websockets: the app proxy's, their `Origin`
    the apps origin or none), anything else there is 404; requests the apps origin's pages send
    to the console (`Origin`: the apps origin) are refused (403; websockets closed 4403); the
    rest goes to `console`. `apps_websocket`: AppWebsocketProxy, as the server's sends should reach it."""

    def __init__(self, console, *, apps_websocket) -> None:
        self.console, self.websocket_proxy = console, apps_websocket
        self.http_proxy, self.login = AppHttpProxy(), AppLogin()

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.console(scope, receive, send)
        if is_apps_request(scope):
            return await self._apps(scope, receive, send)
        if from_apps_origin(scope):
            return await _refuse(scope, receive, send, 403, "The console answers only its own pages.")
        return await self.console(scope, receive, send)

    async def _apps(self, scope, receive, send):
        path = scope["path"]
        if scope["type"] == "http":
            if path == LOGIN_PATH:
                return await self.login(scope, receive, send)
            if PATH_RE.match(path):
                return await self.http_proxy(scope, receive, send)
            return await _refuse(scope, receive, send, 404, "There is nothing here but session apps.")
        origin = header(scope, b"origin")
        if not PATH_RE.match(path) or (origin is not None and origin_key(origin) != origin_key(apps_origin())):
            return await _refuse(scope, receive, send, 403, "")
        return await self.websocket_proxy(scope, receive, send)


async def _refuse(scope, receive, send, status: int, why: str) -> None:
    """Refuse an HTTP request with the proxy's page (`status`), or close a websocket (4403/4404)."""
    if scope["type"] == "websocket":
        if (await receive())["type"] == "websocket.connect":
            await send({"type": "websocket.close", "code": CLOSE_NOT_FOUND if status == 404 else CLOSE_REFUSED})
        return
    await _drain(receive)
    await _page(send, status, {"title": "Not found" if status == 404 else "Refused", "why": why, "console": None})


class AppProxyRouter:
    """ASGI, the console's origin: HTTP under `/sessions/<id>/apps/` to `proxy` (ConsoleAppRedirect),
    everything else to `fallback`."""

    def __init__(self, proxy, fallback) -> None:
        self.proxy, self.fallback = proxy, fallback

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/sessions/")
            and "/apps/" in scope["path"]
            and PATH_RE.match(scope["path"])
        ):
            return await self.proxy(scope, receive, send)
        return await self.fallback(scope, receive, send)


class AppWebsocketProxy:
    """ASGI application for websockets under `/sessions/<id>/apps/<name>/` on the apps origin
    (OriginRouter: its `Origin` checked; signed in by the app-origin cookie, `_check`): connects to
    the app's websocket with the app's token, accepts the browser's with the subprotocol the app
    chose, then relays messages both ways until either side closes (its close code passed on)."""

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        match = PATH_RE.match(scope["path"])
        if match is None or path_escapes(scope):
            await send({"type": "websocket.close", "code": CLOSE_NOT_FOUND})
            return
        status, found = await _check(scope, match)
        if status:
            codes = {401: CLOSE_UNAUTHENTICATED, 404: CLOSE_NOT_FOUND, 410: CLOSE_ENDED}
            await send({"type": "websocket.close", "code": codes.get(status, CLOSE_NOT_FOUND)})
            return
        app, session_id = found["app"], match["session"]
        token = found["token"]
        upstream = await self._connect(scope, match, app, token=token) if token is not None else None
        if upstream is None or token is None:
            _check_forget(scope, match)
            await send({"type": "websocket.close", "code": CLOSE_APP_CLOSED})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        log.debug("app websocket %s of session %s open", app["name"], session_id)
        await _relay_websocket(upstream, receive, send, token=token)

    async def _connect(self, scope, match, app: dict, *, token: str):
        protocols = [
            p.strip()
            for _, v in scope.get("headers", [])
            if _ == b"sec-websocket-protocol"
            for p in v.decode("latin-1").split(",")
            if p.strip()
        ]
        headers = [(n, v) for n, v in upstream_headers(scope, token=token) if n not in ("host", "origin")]
        for attempt in range(2):
            target = await session_app_target(session_id=match["session"], name=app["name"], port=app["port"])
            if isinstance(target, dict):
                return None
            host = f"{_host(target[0])}:{target[1]}"
            proof = RELAYS.get(target)
            try:
                relayed = await relay_socket(target[0], target[1], timeout=CONNECT_TIMEOUT_S)  # with its proof
                return await websockets.connect(
                    f"ws://{host}{upstream_path(scope, match, app, token=token)}",
                    additional_headers=headers,
                    subprotocols=protocols or None,
                    origin=Origin(f"http://{host}"),
                    max_size=WEBSOCKET_MAX_BYTES,
                    compression=None,
                    open_timeout=CONNECT_TIMEOUT_S,
                    user_agent_header=None,
                    proxy=None,
                    sock=relayed,  # None: websockets connects to the URI's host and port itself
                )
            except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
                log.info("app websocket %s: could not connect to %s: %s", app["name"], host, exc)
                if isinstance(exc, websockets.InvalidMessage):  # closed before the app's answer (not a refusal of it)
                    if not attempt and await _relay_changed(match["session"], app, target, proof):
                        continue  # a relay that refused the proof under the key it had before its agent restarted
                    return None
                if not isinstance(exc, OSError):
                    return None
                session_app_target_forget(session_id=match["session"], name=app["name"])
        return None


async def _relay_websocket(upstream, receive, send, *, token: str) -> None:
    masked = "*" * len(token)

    async def browser_to_app() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close()
                return
            if message.get("text") is not None:
                await upstream.send(message["text"])
            elif message.get("bytes") is not None:
                await upstream.send(message["bytes"])

    async def app_to_browser() -> None:
        try:
            async for data in upstream:
                if isinstance(data, str):
                    await send({"type": "websocket.send", "text": data.replace(token, masked)})
                else:
                    await send({"type": "websocket.send", "bytes": data})
        except websockets.ConnectionClosed:
            pass
        code = upstream.close_code if upstream.close_code not in (None, 1005, 1006) else 1000
        await send({"type": "websocket.close", "code": code})

    tasks = [asyncio.create_task(browser_to_app()), asyncio.create_task(app_to_browser())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await upstream.close()
