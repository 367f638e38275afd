"""A small JSON client for `/api/v1/` over stdlib urllib. Every failure becomes one of two
exceptions: ApiError (the server answered 4xx/5xx: its `detail`) or Unreachable (no answer)."""

from __future__ import annotations

import json
import socket

from fgpu_cli import __version__


class ApiError(Exception):
    """The server refused or failed: `status`, `detail` (the API's one-line message), `body`."""

    def __init__(self, status: int, detail: str, body=None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.body = body


class Unreachable(Exception):
    """No HTTP answer: connection refused, DNS, TLS, timeout."""


def error_detail(status: int, reason: str, body) -> str:
    """The API's error JSON is `{"type", "title", "detail", "field_errors"}`; DRF's plain
    `{"detail"}` and `{"field": ["msg"]}` shapes are read too; anything else → the status line."""
    if isinstance(body, dict):
        detail = body.get("detail")
        if isinstance(detail, str) and detail:
            return detail
        if isinstance(detail, list) and detail:
            return " ".join(str(d) for d in detail)
        fields = body.get("field_errors")
        if not isinstance(fields, dict):
            fields = body
        parts = []
        for key, value in fields.items():
            messages = value if isinstance(value, list) else [value]
            parts.append(f"{key}: {' '.join(str(m) for m in messages)}")
        if parts:
            return "; ".join(parts)
    if isinstance(body, list) and body:
        return " ".join(str(x) for x in body)
    return f"the server answered {status} {reason}".rstrip()


class Client:
    def __init__(self, url: str, token: str = "", *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body=None,
        *,
        query: dict | None = None,
        auth: bool = True,
        headers: dict[str, str] | None = None,
    ):
        """`path` below the server root (`/api/v1/sessions/`) or an absolute URL (pagination's
        `next`); `headers` are sent besides the client's own. Returns the decoded JSON (None for
        an empty body)."""
        headers = dict(headers or {})
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        with self.open(method, path, query=query, data=data, auth=auth, headers=headers) as response:
            raw = self.guarded(response.read)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(0, f"{response.url} did not answer JSON (is {self.url} an fGPU Console?)") from None

    def open(
        self,
        method: str,
        path: str,
        *,
        query: dict | None = None,
        data=None,
        auth: bool = True,
        headers: dict[str, str] | None = None,
    ):
        """The open HTTP response (read it in chunks, then close it: a `with` block), for bodies
        that are not JSON: a file's bytes. `data`: bytes or a binary file object (streamed; give
        its Content-Length in `headers`). Raises ApiError / Unreachable as `request` does."""
        import urllib.parse
        import urllib.request  # here, not at the top: `fgpu --help` starts without http.client and ssl

        url = path if path.startswith(("http://", "https://")) else self.url + path
        if query:
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json", "User-Agent": f"fgpu-cli/{__version__}", **(headers or {})}
        if auth and self.token:
            headers["Authorization"] = f"Token {self.token}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        return self.guarded(urllib.request.urlopen, request, timeout=self.timeout)

    def guarded(self, call, *args, **kwargs):
        """`call(*args, **kwargs)` with urllib's failures turned into ApiError / Unreachable."""
        import urllib.error

        try:
            return call(*args, **kwargs)
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read()
            except OSError:
                raw = b""
            raise ApiError(exc.code, error_detail(exc.code, exc.reason or "", _json_or_none(raw)), _json_or_none(raw)) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            raise Unreachable(f"cannot reach {self.url}: {reason}") from None
        except (socket.timeout, TimeoutError):
            raise Unreachable(f"cannot reach {self.url}: no answer within {self.timeout:g} s") from None
        except (ConnectionError, OSError) as exc:
            raise Unreachable(f"cannot reach {self.url}: {exc}") from None

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body if body is not None else {}, **kw)

    def delete(self, path, **kw):
        return self.request("DELETE", path, **kw)

    def get_all(self, path: str, query: dict | None = None) -> list:
        """Every item of a paginated list (`{"count", "next", "results"}`), following `next`."""
        page = self.get(path, query={"limit": 500, **(query or {})})
        if isinstance(page, list):
            return page
        items = list(page.get("results", []))
        while page.get("next"):
            page = self.get(page["next"])
            items.extend(page.get("results", []))
        return items

    def websocket_url(self, path: str) -> str:
        """`/ws/…` on the same server: http → ws, https → wss."""
        scheme, rest = self.url.split("://", 1)
        host = rest.split("/", 1)[0]
        return f"{'wss' if scheme == 'https' else 'ws'}://{host}{path}"


def _json_or_none(raw: bytes):
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None
