"""ASGI middleware in front of Django: a request body is refused before it is read (issue 31.7).

Django's ASGI handler reads a whole request body (into a temporary file) before any view, any
authentication or any size check runs: an unauthenticated client declaring 20 GiB would have the
web store all of it. `UploadGuard` decides from the request's head alone, before a byte of the
body is received:

- The upload path (`PUT /api/v1/sessions/<id>/files/content/`) needs an authenticated caller: a
  valid `Authorization: Token <key>` (the API's own authentication class,
  accounts.authentication.ApiTokenAuthentication) or a signed-in session cookie. Else 401 at once.
  Its body may be up to UPLOAD_MAX_BYTES (FGPU_FILES_USER_CAP: no upload may pass it anyway).
- Any other request may send up to SMALL_BODY_BYTES (Django's DATA_UPLOAD_MAX_MEMORY_SIZE,
  2.5 MiB by default) without being asked who it is: the login form and `POST /api/v1/auth/token/`
  need none. A larger body, or one sent without Content-Length (chunked), needs an authenticated
  caller (else 401) and may be up to OTHER_MAX_BYTES (an accelerator config file is far smaller).
- A declared Content-Length over the limit: 413 at once. A body that passes the limit as it
  arrives (chunked, or longer than declared) is cut off there: the application receives a
  disconnect (Django drops the request) and the client a 413.

Every refusal is the API's error shape (`{"type", "title", "detail", "field_errors"}`) with
`Connection: close`, so the server closes the connection rather than read the body it did not
want. The checks run on a thread (sync_to_async) in a context of the request's own; they read the
database only when a body needs them. What passes goes to Django unchanged.
"""

from __future__ import annotations

import json
import re
from http.cookies import CookieError, SimpleCookie

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.db import connections

# The console's upload paths: (method, path pattern) whose bodies may be as large as an upload.
UPLOAD_PATHS = [("PUT", re.compile(r"^/api/v1/sessions/[0-9a-fA-F-]{32,36}/files/content/$"))]
OTHER_MAX_BYTES = 64 * 1024**2  # an authenticated caller's body anywhere else: 64 MiB


def is_upload(scope) -> bool:
    """Whether the request (an HTTP scope) is to an upload path (UPLOAD_PATHS), whose body its view
    reads as it arrives (common.request_body.StreamedBody, console.asgi)."""
    return any(scope["method"] == method and pattern.match(scope["path"]) for method, pattern in UPLOAD_PATHS)


def upload_max_bytes() -> int:
    """The most bytes an upload body may have: FGPU_FILES_USER_CAP (10 GiB by default), the cap
    of a persistent folder and of a session's home, which no single file may pass."""
    return int(settings.FGPU_FILES_USER_CAP)


def small_body_bytes() -> int:
    """The most bytes a body may have without an authenticated caller: Django's
    DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MiB by default; None there: 2.5 MiB here)."""
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 2621440)


class UploadGuard:
    """ASGI middleware (HTTP only; anything else passes untouched) refusing request bodies before
    they are read: see the module docstring. `app` is the ASGI application it guards (Django's)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        try:
            declared = int(headers["content-length"]) if "content-length" in headers else None
        except ValueError:
            declared = None  # servers refuse such a request themselves; a count still applies
        if not chunked and not declared:
            return await self.app(scope, receive, send)  # no body to guard
        upload = is_upload(scope)
        small = small_body_bytes()
        if upload or declared is None or declared > small:
            async with ThreadSensitiveContext():
                signed_in = await sync_to_async(caller_authenticated, thread_sensitive=True)(headers)
            if not signed_in and (upload or (declared is not None and declared > small)):
                return await _refuse(send, 401, "not-authenticated", "Not authenticated", _why_401(upload, small))
            limit = upload_max_bytes() if upload else (OTHER_MAX_BYTES if signed_in else small)
        else:
            limit = small
        if declared is not None and declared > limit:
            return await _refuse(send, 413, "too-large", "Request body too large", _why_413(declared, limit))
        await _CountedBody(self.app, limit).serve(scope, receive, send)


class _CountedBody:
    """Runs `app` with a receive that counts the body's bytes: past `limit`, the app gets
    `http.disconnect` and the client a 413 (unless the app has already begun its answer)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.received = 0
        self.cut = False
        self.answer_started = False

    async def serve(self, scope, receive, send) -> None:
        async def counted_receive():
            if self.cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.limit:
                    self.cut = True
                    if not self.answer_started:
                        self.answer_started = True
                        await _refuse(send, 413, "too-large", "Request body too large", _why_cut(self.limit))
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message):
            if self.cut:
                return  # the 413 is the answer; what the app says after the cut is dropped
            if message["type"] == "http.response.start":
                self.answer_started = True
            await send(message)

        await self.app(scope, counted_receive, watched_send)


def caller_authenticated(headers: dict[str, str]) -> bool:
    """Whether the request with these headers (lower-case names) comes from an active user: a
    valid `Authorization: Token <key>` (accounts.authentication, the API's own check: a named
    API token or a login token), else a signed-in session cookie (Django's auth: the session's
    user, with its password hash check). Runs queries: call it on a thread. Gives its database
    connection back before it returns."""
    try:
        authorization = headers.get("authorization", "")
        if authorization:
            return _token_user_active(authorization)
        return _session_user_active(headers.get("cookie", ""))
    finally:
        connections.close_all()


def _token_user_active(authorization: str) -> bool:
    from rest_framework import exceptions

    from accounts.authentication import ApiTokenAuthentication

    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "token":
        return False
    try:
        user, _ = ApiTokenAuthentication().authenticate_credentials(parts[1])
    except exceptions.AuthenticationFailed:
        return False
    return bool(user.is_active)


def _session_user_active(cookie_header: str) -> bool:
    from importlib import import_module

    from django.contrib.auth import get_user

    cookies = SimpleCookie()
    try:
        cookies.load(cookie_header)
    except CookieError:
        return False
    morsel = cookies.get(settings.SESSION_COOKIE_NAME)
    if morsel is None or not morsel.value:
        return False
    store = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)

    class _Request:  # what django.contrib.auth.get_user reads of a request
        session = store

    user = get_user(_Request())  # type: ignore[arg-type]  # duck-typed: only .session is read
    return bool(user.is_authenticated and user.is_active)


def _headers(scope) -> dict[str, str]:
    """The request's headers, names lower-case; a repeated header's values joined by ", " (a
    cookie header by "; ")."""
    out: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        if name in out:
            out[name] += ("; " if name == "cookie" else ", ") + value
        else:
            out[name] = value
    return out


def _why_401(upload: bool, small: int) -> str:
    if upload:
        return "Authentication credentials were not provided or are not valid (Authorization: Token <key>, or sign in)."
    return f"A request body over {small} bytes needs authentication (Authorization: Token <key>, or sign in)."


def _why_413(declared: int, limit: int) -> str:
    return f"The request body ({declared} bytes) is larger than this path accepts ({limit} bytes)."


def _why_cut(limit: int) -> str:
    return f"The request body passed the {limit} bytes this path accepts; it was cut off there."


async def _refuse(send, status: int, type: str, title: str, detail: str) -> None:
    """Answer `status` with the API's error shape, closing the connection after it."""
    body = json.dumps({"type": type, "title": title, "detail": detail, "field_errors": {}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Token"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
