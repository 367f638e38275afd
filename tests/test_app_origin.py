"""Session apps on their own origin (issue 31.4), against the console as `make run` starts it
(standalone, the process runtime, apps on PORT + 1), with a real app in the session
(tests/apps/echo_app.py); and the tickets' and grants' rules in process.

The console's origin hands a signed-in user on to the apps origin with a one-time ticket, which
becomes the app-origin cookie (HttpOnly, SameSite=Lax, its path the app's); the apps origin
serves nothing of the console (404), the console refuses what the apps origin's pages send
(403); the ticket is single use, expires and opens only its session's app; app tokens are new
at each start and not the old HMAC of SECRET_KEY. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import socket
import sys
import time
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.conftest import ROOT, wait_until
from tests.stack import free_port
from tests.test_browser import page  # noqa: F401  (fixture)

ADMIN_PASSWORD = "admin-pass-app-origin"
ECHO = f"PYTHONPATH={ROOT / 'tests' / 'apps'} exec {sys.executable} -m daphne -b {{host}} -p {{port}} echo_app:application"
APPS = [
    {"name": "echo", "title": "Echo", "command": ECHO, "port": 8080, "base_url": True, "timeout": 60},
    {"name": "plain", "title": "Plain", "command": "ECHO_APP_PREFIXED=0 " + ECHO, "port": 8081, "base_url": False, "timeout": 60},
]


def _free_pair() -> int:
    """A free port whose next port is free too (standalone serves apps on PORT + 1)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


def start_standalone(procs, tmp_path, **env_extra) -> tuple[str, str, object]:
    """A standalone console; (console base, apps base, its Proc) once it serves. Its node runs
    sessions unconfined (`sandbox = "none"`): the echo app runs from this checkout's tests/apps,
    which a sandboxed session does not see; what is tested here is the origin, not the sandbox."""
    port = _free_pair()
    agent = tmp_path / "agent.toml"
    agent.write_text(
        (ROOT / "demo" / "agent.toml")
        .read_text()
        .replace('config = "mock-accelerator.toml"', f'config = "{ROOT / "demo" / "mock-accelerator.toml"}"')
        + '\n[container]\nsandbox = "none"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(
        FGPU_DATA_DIR=str(tmp_path / "data"),
        FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD,
        PORT=str(port),
        PYTHONUNBUFFERED="1",
        FGPU_RUNTIME="process",
        FGPU_AGENT_CONFIG=str(agent),
        **env_extra,
    )
    server = procs.start("standalone", [sys.executable, "manage.py", "standalone"], env)
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert server.popen.poll() is None, f"standalone exited:\n{server.output()}"
        return "Session apps are served on" in server.output()

    wait_until(ready, timeout=90, interval=0.2, what="the standalone console to serve")
    return base, f"http://localhost:{port + 1}", server


def api(base: str, method: str, path: str, token: str | None = None, body=None, headers: dict | None = None):
    answer = httpx.request(
        method,
        base + path,
        json=body,
        timeout=60,
        headers={**({"Authorization": f"Token {token}"} if token else {}), **(headers or {})},
    )
    return answer


def login(base: str, username: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=base, timeout=60, follow_redirects=False)
    form = client.get("/login/")
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    assert (
        client.post("/login/", data={"username": username, "password": password, "csrfmiddlewaretoken": csrf}).status_code == 302
    )
    return client


@pytest.fixture
def apps_console(procs, tmp_path):
    """Standalone with the apps declared on "host" and a RUNNING session of the admin's:
    (console base, apps base, admin API token, session id)."""
    base, apps, _ = start_standalone(procs, tmp_path)
    token = api(base, "POST", "/api/v1/auth/token/", body={"username": "admin", "password": ADMIN_PASSWORD}).json()["token"]
    host = next(i for i in api(base, "GET", "/api/v1/images/", token).json()["results"] if i["reference"] == "host")
    tag = api(base, "GET", f"/api/v1/images/{host['id']}/", token).headers["ETag"]
    assert api(base, "PATCH", f"/api/v1/images/{host['id']}/", token, {"apps": APPS}, {"If-Match": tag}).status_code == 200
    created = api(base, "POST", "/api/v1/sessions/", token, {"name": "apps", "resources": {"cuda.shares": "0.5"}}).json()
    wait_until(
        lambda: api(base, "GET", f"/api/v1/sessions/{created['id']}/", token).json()["status"] == "RUNNING",
        timeout=60,
        what="the session to run",
    )
    return base, apps, token, created["id"]


def open_app(base: str, token: str, session_id: str, app: str) -> dict:
    answer = api(base, "POST", f"/api/v1/sessions/{session_id}/apps/{app}/", token)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ticket_for(console: httpx.Client, path: str, apps: str) -> str:
    """The ticket the console's origin hands on for `path` (its redirect to the apps origin)."""
    answer = console.get(path)
    assert answer.status_code == 302, answer.text[:500]
    location = answer.headers["location"]
    assert location.startswith(apps + "/_fgpu/app-login?ticket="), location
    return parse_qs(urlsplit(location).query)["ticket"][0]


@pytest.mark.e2e
def test_an_app_opens_on_its_own_origin_through_a_one_time_ticket_and_the_console_is_not_served_there(apps_console):
    base, apps, token, session_id = apps_console
    prefix = f"/sessions/{session_id}/apps/echo/"
    opened = open_app(base, token, session_id, "echo")
    assert opened["url"] == prefix
    console = login(base, "admin", ADMIN_PASSWORD)

    # The console's origin: signed out, the login page; signed in, a ticket to the apps origin.
    signed_out = httpx.get(base + prefix + "echo", timeout=30)
    assert signed_out.status_code == 302 and signed_out.headers["location"].startswith("/login/?next=")
    ticket = ticket_for(console, prefix + "echo?q=1", apps)
    assert console.post(prefix + "echo").status_code == 405  # nothing is proxied on the console's origin

    # The apps origin: the ticket becomes its cookie, and the browser goes on without the ticket.
    browser = httpx.Client(base_url=apps, timeout=60, follow_redirects=False)
    landed = browser.get(f"/_fgpu/app-login?ticket={ticket}")
    assert landed.status_code == 302 and landed.headers["location"] == prefix + "echo?q=1"
    cookie = landed.headers["set-cookie"]
    assert cookie.startswith("fgpu_app=") and f"Path={prefix};" in cookie
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie  # http here
    echoed = browser.get(prefix + "echo?q=1")
    assert echoed.status_code == 200, echoed.text
    body = echoed.json()
    assert body["authorized"] is True and body["console_cookie"] is False and body["query"] == "q=1"

    # Used once: a second redemption is refused and sets nothing.
    again = httpx.get(f"{apps}/_fgpu/app-login?ticket={ticket}", timeout=30)
    assert again.status_code == 403 and "set-cookie" not in again.headers
    # Without the cookie, or with only the console's, the apps origin opens nothing.
    stranger = httpx.get(apps + prefix + "echo", timeout=30, cookies=dict(console.cookies))
    assert stranger.status_code == 401 and "authorized" not in stranger.text

    # The grant is for its app: another app of the same session needs its own ticket.
    open_app(base, token, session_id, "plain")
    browser.cookies.set("fgpu_app", browser.cookies["fgpu_app"], path=f"/sessions/{session_id}/apps/plain/")
    assert browser.get(f"/sessions/{session_id}/apps/plain/echo").status_code == 401

    # The apps origin serves nothing of the console; the console refuses its pages' requests.
    for path in ("/login/", "/api/v1/me/", "/admin/", "/static/js/console.js", f"/sessions/{session_id}/terminal/"):
        assert browser.get(path).status_code == 404, path
    from_app = console.get("/api/v1/me/", headers={"Origin": apps})
    assert from_app.status_code == 403 and "username" not in from_app.text
    assert console.get("/api/v1/me/").status_code == 200


@pytest.mark.e2e
def test_an_app_gets_a_new_random_token_at_each_start_never_the_hmac_of_the_secret_key(apps_console):
    from django.conf import settings

    base, apps, token, session_id = apps_console
    prefix = f"/sessions/{session_id}/apps/echo/"
    console = login(base, "admin", ADMIN_PASSWORD)

    def token_hash() -> str:
        open_app(base, token, session_id, "echo")
        browser = httpx.Client(base_url=apps, timeout=60, follow_redirects=True)
        browser.get(f"/_fgpu/app-login?ticket={ticket_for(console, prefix + 'echo', apps)}")
        echoed = browser.get(prefix + "echo")
        assert echoed.status_code == 200, echoed.text
        return echoed.json()["token_sha256"], browser

    first, browser = token_hash()
    assert browser.get(prefix + "exit").status_code == 200  # the app ends; its next start is a new one
    wait_until(lambda: browser.get(prefix + "echo").status_code == 502, timeout=30, what="the app to be gone")
    second, _ = token_hash()
    assert first != second
    for key in (settings.SECRET_KEY, "dev-only-insecure-key-set-FGPU_SECRET_KEY-in-production"):
        derived = hmac.new(key.encode(), f"fgpu-app:{session_id}:echo".encode(), hashlib.sha256).hexdigest()[:48]
        assert hashlib.sha256(derived.encode()).hexdigest() not in (first, second)


# --- in process: the ticket's and the grant's rules ---------------------------------------------


def test_a_ticket_is_single_use_and_bound_to_its_user_session_and_app(settings):
    from sessions.serving.origin import app_grant_find, app_grant_issue, app_ticket_issue, app_ticket_redeem

    session = "0b0e2f3c-1d2e-4f5a-8b9c-0d1e2f3a4b5c"
    ticket = app_ticket_issue(user_id=7, auth="h", session_id=session, app="echo", path="/x", console="http://c")
    record = app_ticket_redeem(ticket)
    assert record == {"user": 7, "auth": "h", "session": session, "app": "echo", "path": "/x", "console": "http://c"}
    assert app_ticket_redeem(ticket) is None
    assert app_ticket_redeem("not-a-ticket") is None and app_ticket_redeem("x" * 100) is None
    grant = app_grant_issue(record)
    assert app_grant_find([grant], session_id=session, app="echo")["user"] == 7
    assert app_grant_find([grant], session_id=session, app="plain") is None
    assert app_grant_find([grant], session_id="11111111-1111-1111-1111-111111111111", app="echo") is None
    assert app_grant_find(["forged", grant[:-1]], session_id=session, app="echo") is None


def test_a_ticket_expires_after_its_ttl(settings, monkeypatch):
    import django.core.cache.backends.locmem as locmem

    from sessions.serving.origin import app_ticket_issue, app_ticket_redeem

    settings.FGPU_APP_TICKET_TTL = 30
    ticket = app_ticket_issue(user_id=1, auth="h", session_id="s", app="a", path="/", console="")
    later = time.time() + 31
    monkeypatch.setattr(locmem.time, "time", lambda: later)  # the clock, 31 s on
    assert app_ticket_redeem(ticket) is None


@pytest.mark.parametrize(
    "host, apps, expected",
    [
        ("127.0.0.1:8001", "http://127.0.0.1:8001", True),
        ("127.0.0.1:8000", "http://127.0.0.1:8001", False),
        ("APPS.example.org", "https://apps.example.org", True),
        ("apps.example.org:443", "https://apps.example.org", True),
        ("apps.example.org:8443", "https://apps.example.org", False),
        ("gpu.example.org", "https://apps.example.org", False),
        ("[::1]:8001", "http://[::1]:8001", True),
        ("whatever", "", False),
    ],
)
def test_the_apps_origin_is_told_apart_by_the_host_header(settings, host, apps, expected):
    from sessions.serving.origin import is_apps_request

    settings.FGPU_APPS_ORIGIN = apps
    assert is_apps_request({"type": "http", "headers": [(b"host", host.encode())]}) is expected


@pytest.mark.parametrize(
    "value",
    [
        "apps.example.org",
        "ftp://apps.example.org",
        "http://apps.example.org/x",
        "http://user@apps.example.org",
        "http://apps.example.org:99999",
        "http://",
    ],
)
def test_a_malformed_apps_origin_is_refused_at_start(value):
    from django.core.exceptions import ImproperlyConfigured

    from console.settings import _apps_origin

    with pytest.raises(ImproperlyConfigured, match="FGPU_APPS_ORIGIN"):
        _apps_origin(value)
    assert _apps_origin("HTTP://Apps.Example.org:8001/") == "http://apps.example.org:8001"


def test_the_console_answers_with_its_security_headers(client):
    answer = client.get("/login/")
    policy = answer["Content-Security-Policy"]
    assert "script-src 'self';" in policy and "frame-ancestors 'none'" in policy and "default-src 'self'" in policy
    assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";", 1)[0]
    assert answer["X-Frame-Options"] == "DENY" and answer["Referrer-Policy"] == "same-origin"
    assert answer["X-Content-Type-Options"] == "nosniff"
    assert answer.cookies["csrftoken"]["httponly"]


def test_over_tls_the_console_sends_hsts_and_secure_cookies():
    """console.settings under FGPU_TLS=true, in a fresh interpreter (settings are read once)."""
    import subprocess

    script = (
        "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='console.settings'; django.setup();"
        "from django.conf import settings as s; import json;"
        "print(json.dumps([s.SECURE_HSTS_SECONDS, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE]))"
    )
    env = {**os.environ, "FGPU_TLS": "true"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    hsts, session_secure, csrf_secure = json.loads(out.stdout.strip().splitlines()[-1])
    assert hsts >= 365 * 86400 and session_secure and csrf_secure


@pytest.mark.browser
def test_the_consoles_pages_run_their_scripts_under_its_content_security_policy(procs, tmp_path, page):  # noqa: F811
    """Chromium reports every script, style or connection the CSP blocks as a console error (the
    `page` fixture collects them): the session list (its live websocket), the API docs (Swagger
    UI, whose start script is a file of its own) and an admin page load with none."""
    from playwright.sync_api import expect

    from tests.test_browser_workloads import log_in

    base, _, _ = start_standalone(procs, tmp_path)
    log_in(page, base, password=ADMIN_PASSWORD)  # waits for the session list's websocket: "live"
    assert "script-src 'self'" in page.context.request.get(base + "/sessions/").headers["content-security-policy"]
    page.goto(base + "/api/docs/")
    expect(page.locator("#swagger-ui .opblock").first).to_be_visible(timeout=30_000)
    page.goto(base + "/admin/compute_sessions/sessionimage/")
    expect(page.locator("#result_list")).to_be_visible()
    # Only what the policy blocked counts here (a favicon's 404, say, is another matter).
    assert not [e for e in page.js_errors if "Content Security Policy" in e or "Refused to" in e], page.js_errors


@pytest.mark.django_db
def test_a_grant_is_checked_again_on_every_request_a_deactivated_user_a_changed_password_or_another_users_session_opens_nothing(
    alices_session, alice, bob, staff
):
    from django.http import Http404

    from sessions.serving.origin import app_grant_issue
    from sessions.serving.proxy import _granted_lookup

    image = alices_session.image
    image.apps = [APPS[0]]
    image.save(update_fields=["apps"])
    session = str(alices_session.pk)

    def grant(user) -> str:
        return app_grant_issue(
            {"user": user.pk, "auth": user.get_session_auth_hash(), "session": session, "app": "echo", "console": "http://c"}
        )

    mine, bobs, admins = grant(alice), grant(bob), grant(staff)
    assert _granted_lookup([mine], session, "echo")["console"] == "http://c"
    assert _granted_lookup([admins], session, "echo") is not None  # administrators may open users' apps
    with pytest.raises(Http404):
        _granted_lookup([bobs], session, "echo")  # a grant names a user; the session is not bob's
    staff.set_password("another-password-123")
    staff.save(update_fields=["password"])
    assert _granted_lookup([admins], session, "echo") is None  # its password changed: signed out of apps too
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    assert _granted_lookup([mine], session, "echo") is None


def _apps_request(settings, alices_session, alice) -> tuple[dict, str]:
    """A GET of alice's echo app on the apps origin with her grant's cookie: (ASGI scope, session id)."""
    from sessions.serving.origin import app_grant_issue

    settings.FGPU_APPS_ORIGIN = "http://apps.test:8001"
    image = alices_session.image
    image.apps = [APPS[0]]
    image.save(update_fields=["apps"])
    session = str(alices_session.pk)
    grant = app_grant_issue(
        {"user": alice.pk, "auth": alice.get_session_auth_hash(), "session": session, "app": "echo", "console": "http://c"}
    )
    scope = {
        "type": "http",
        "method": "GET",
        "path": f"/sessions/{session}/apps/echo/echo",
        "query_string": b"",
        "headers": [(b"host", b"apps.test:8001"), (b"cookie", f"{settings.FGPU_APPS_COOKIE}={grant}".encode())],
    }
    return scope, session


async def _proxy_answer(scope: dict, pieces=(b"",)) -> dict:
    """One request through the app proxy (AppHttpProxy) as the web server hands it over: `scope`, its
    body in `pieces`, then nothing more (the browser waits for the answer). The answer: `{"status",
    "headers", "body"}`."""
    from sessions.serving import proxy

    waiting, sent, never = list(pieces), [], asyncio.get_running_loop().create_future()

    async def receive():
        if waiting:
            return {"type": "http.request", "body": waiting.pop(0), "more_body": len(waiting) > 0}
        return await never

    async def send(message):
        sent.append(message)

    await proxy.AppHttpProxy()(dict(scope), receive, send)
    return {"status": sent[0]["status"], "headers": sent[0]["headers"], "body": b"".join(m.get("body", b"") for m in sent[1:])}


def _through_proxy(app, scope: dict, session: str, *, times: int = 1) -> list[dict]:
    """`times` requests of `scope` through the proxy (`_proxy_answer`, one after another) to `app`, an
    asyncio.start_server handler on loopback standing for the echo app of `session` (its address the
    one the agent would name); the app and the proxy's connections closed after."""
    from asgiref.sync import async_to_sync

    from sessions.serving import proxy, session_apps

    async def run() -> list[dict]:
        server = await asyncio.start_server(app, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        session_apps.APP_TARGETS[(session, "echo")] = ("127.0.0.1", port, time.monotonic() + 600)
        try:
            return [await _proxy_answer(scope) for _ in range(times)]
        finally:
            server.close()
            session_apps.APP_TARGETS.pop((session, "echo"), None)
            await proxy._pools.pop(id(asyncio.get_running_loop())).aclose()

    return async_to_sync(run)()


@pytest.mark.django_db(transaction=True)  # the check reads on Channels' database thread, which closes connections
def test_a_kept_check_carries_the_apps_token_until_this_process_opens_the_app_again(settings, alices_session, alice, monkeypatch):
    from asgiref.sync import async_to_sync
    from django.core.cache import cache

    from sessions.serving import proxy
    from sessions.serving.session_apps import TOKEN_KEY, _app_token_keep

    monkeypatch.setattr(proxy, "CHECK_TTL_S", 600.0)  # this test's own pace does not matter
    scope, session = _apps_request(settings, alices_session, alice)
    match = proxy.PATH_RE.match(scope["path"])
    cache.set(TOKEN_KEY.format(session=session, app="echo"), "first-token")
    check = async_to_sync(proxy._check)
    status, found = check(scope, match)
    assert status == 0 and found["token"] == "first-token" and not found.get("kept")
    status, found = check(scope, match)
    assert status == 0 and found["token"] == "first-token" and found["kept"]  # no database, no cache read
    async_to_sync(_app_token_keep)(session_id=session, app="echo", token="second-token")  # opened again here
    status, found = check(scope, match)
    assert status == 0 and found["token"] == "second-token" and not found.get("kept")
    assert check(scope, match)[1]["kept"]


@pytest.mark.django_db(transaction=True)
def test_an_app_refusing_a_kept_token_opened_again_by_another_process_gets_the_request_again_with_the_new_one(
    settings, alices_session, alice, monkeypatch
):
    from django.core.cache import cache

    from sessions.serving import proxy, session_apps

    monkeypatch.setattr(proxy, "CHECK_TTL_S", 600.0)
    scope, session = _apps_request(settings, alices_session, alice)
    key = session_apps.TOKEN_KEY.format(session=session, app="echo")
    running = {"token": "first-token"}
    seen = []

    async def app(reader, writer):  # the app in the session: its token or 403, as Jupyter; one answer per connection
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        sent_token = next((line.split(":", 1)[1].strip() for line in head if line.lower().startswith("authorization:")), None)
        seen.append(sent_token)
        body = b"hello\n" if sent_token == f"token {running['token']}" else b"no token\n"
        status = b"200 OK" if body == b"hello\n" else b"403 Forbidden"
        writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
        writer.close()

    def get() -> tuple[int, bytes]:
        answer = _through_proxy(app, scope, session)[0]
        return answer["status"], answer["body"]

    cache.set(key, "first-token")
    assert get() == (200, b"hello\n")
    # Another web process opens the app again: a new token in the cache, this process's kept check unaware.
    running["token"] = "second-token"
    cache.set(key, "second-token")
    seen.clear()
    assert get() == (200, b"hello\n")
    assert seen == ["token first-token", "token second-token"]  # refused with the kept one, then sent again
    assert get() == (200, b"hello\n") and seen[-1] == "token second-token"


@pytest.mark.django_db(transaction=True)
def test_the_proxy_keeps_no_cookie_an_app_set_for_another_request(settings, alices_session, alice):
    """The proxy's client holds no cookie jar: a cookie an app sets goes to the browser that got the
    answer, never with the proxy's next request to that app (httpx's client kept it and sent it with
    any later request that carried no cookie of its own, another browser's too)."""
    from django.core.cache import cache

    from sessions.serving import session_apps

    scope, session = _apps_request(settings, alices_session, alice)
    cache.set(session_apps.TOKEN_KEY.format(session=session, app="echo"), "app-token")
    cookies = []

    async def app(reader, writer):  # the app in the session: sets a cookie on every answer, connections kept
        while True:
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            except asyncio.IncompleteReadError:
                writer.close()
                return
            cookies.append(next((line.split(":", 1)[1].strip() for line in head if line.lower().startswith("cookie:")), None))
            writer.write(b"HTTP/1.1 200 OK\r\nset-cookie: app-login=alices-secret; Path=/\r\ncontent-length: 3\r\n\r\nok\n")
            await writer.drain()

    answers = _through_proxy(app, scope, session, times=2)
    assert [answer["status"] for answer in answers] == [200, 200]
    for answer in answers:  # the browser gets the cookie
        assert (b"set-cookie", b"app-login=alices-secret; Path=/") in answer["headers"]
    assert cookies == [None, None]  # the second request carries no cookie the proxy kept
