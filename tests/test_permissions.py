"""Who may do what, for every endpoint, page and websocket: anonymous, another user, the owner,
an administrator. Another user's session is a 404, never a 403, so session ids do not leak.
Pages need CSRF on POST; websockets refuse a foreign Origin.

The anonymous checks walk the URLconf, so an endpoint or page added later is covered without
being listed here; anything public must be named in PUBLIC_* below.
"""
from __future__ import annotations

import asyncio
import re
import uuid

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RegexPattern, RoutePattern
from rest_framework.test import APIClient

from accounts import services as account_services
from accounts.models import ApiToken, LoginToken
from console.asgi import application
from sessions.lifecycle import events
from sessions.lifecycle import services
from sessions.consumers import CLOSE_BAD_TICKET, CLOSE_UNAUTHENTICATED
from sessions.models import ComputeSession, SessionStatus
from tests.conftest import assert_error_shape, client_for
WS_TIMEOUT = 10
GOOD_ORIGIN = (b"origin", b"http://localhost:8000")

# Routes anyone may call. Everything else under /api/v1/ answers 401 to the anonymous, and
# every other page sends them to the login page.
PUBLIC_API = {"/api/v1/auth/token/"}
PUBLIC_PAGES = {"/login/", "/logout/"}
# Not a page: Prometheus scrapes it with a bearer token, never a login (its gating: tests/test_usage.py).
TOKEN_ROUTES = {"/metrics"}
# What a signed-in user (not an administrator) may write: their own sessions and tokens.
USER_WRITABLE_API = {
    ("post", "/api/v1/auth/token/"),
    ("post", "/api/v1/sessions/"),
    ("post", "/api/v1/sessions/preview/"),
    ("delete", "/api/v1/sessions/{id}/"),
    ("post", "/api/v1/sessions/{id}/terminal-ticket/"),
    ("post", "/api/v1/sessions/{id}/exec/"),
    ("delete", "/api/v1/sessions/{id}/exec/{id}/"),  # cancel a streamed exec
    ("post", "/api/v1/sessions/{id}/apps/{app}/"),  # open a session app
    ("post", "/api/v1/shares/"),  # share one's own ~/data (a project's folder: administrators; tests/test_folder_shares.py)
    ("delete", "/api/v1/shares/{id}/"),  # revoke one's share, or leave one shared with you (tests/test_folder_shares.py)
}
WRITE_METHODS = ("post", "put", "patch", "delete")


# --- the URLconf, walked ------------------------------------------------------------------------

_SAMPLE_ID = "00000000-0000-4000-8000-000000000000"
_CONVERTED = re.compile(r"<(?:(?P<converter>\w+):)?(?P<name>\w+)>")
_NAMED_GROUP = re.compile(r"\(\?P<(?P<name>\w+)>[^)]*\)")


def _sample(pattern) -> str | None:
    """A concrete path piece that `pattern` matches, ids replaced by `{id}`; None for DRF's
    format-suffix variants (`.json`)."""
    if isinstance(pattern, RoutePattern):
        if ":format>" in str(pattern):
            return None
        return _CONVERTED.sub(lambda m: "1" if m["converter"] == "int" else "{id}", str(pattern))
    if isinstance(pattern, RegexPattern):
        regex = str(pattern)
        if "(?P<format>" in regex:
            return None
        return _NAMED_GROUP.sub(lambda m: "{app}" if m["name"] == "app" else "{id}", regex).lstrip("^").rstrip("$")
    raise TypeError(f"unknown pattern type {pattern!r}")


def _walk(patterns, prefix: str = ""):
    for entry in patterns:
        piece = _sample(entry.pattern)
        if piece is None:
            continue
        if isinstance(entry, URLResolver):
            yield from _walk(entry.url_patterns, prefix + piece)
        elif isinstance(entry, URLPattern):
            yield "/" + prefix + piece


def routes() -> list[str]:
    """Every route in the URLconf as a path template (`/api/v1/sessions/{id}/`)."""
    return sorted(set(_walk(get_resolver().url_patterns)))


def api_routes() -> list[str]:
    return [r for r in routes() if r.startswith("/api/v1/") and r not in PUBLIC_API]


def page_routes() -> list[str]:
    return [r for r in routes() if not r.startswith(("/api/", "/admin/")) and r not in PUBLIC_PAGES | TOKEN_ROUTES]


def concrete(template: str, session_id=None) -> str:
    return template.replace("{id}", str(session_id or _SAMPLE_ID)).replace("{app}", "jupyter")  # a session app's name


# --- people and things --------------------------------------------------------------------------

def pages_as(user, **kwargs) -> Client:
    client = Client(**kwargs)
    if user is not None:
        client.force_login(user)
    return client


# --- anonymous ----------------------------------------------------------------------------------

def test_the_url_walk_finds_the_known_endpoints_and_pages():
    found = routes()
    for expected in ("/api/v1/sessions/", "/api/v1/sessions/{id}/", "/api/v1/sessions/{id}/terminal-ticket/",
                     "/api/v1/nodes/", "/api/v1/launch-options/", "/api/v1/auth/token/", "/sessions/",
                     "/sessions/{id}/terminal/", "/account/", "/account/tokens/{id}/revoke/", "/login/"):
        assert expected in found, f"{expected} not in {found}"


@pytest.mark.django_db
@pytest.mark.parametrize("route", api_routes())
@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete"])
def test_every_api_endpoint_answers_401_to_the_anonymous(demo_cluster, route, method):
    response = getattr(APIClient(), method)(concrete(route), {}, format="json")

    body = assert_error_shape(response, 401)
    assert body["title"] == "Not authenticated"
    assert response["WWW-Authenticate"].startswith("Token")


@pytest.mark.django_db
@pytest.mark.parametrize("route", page_routes())
def test_every_page_sends_the_anonymous_to_the_login_page(demo_cluster, route):
    path = concrete(route)

    response = Client().get(path)

    assert response.status_code == 302, (path, response.status_code)
    assert response["Location"].startswith("/login/?next=")


@pytest.mark.django_db
@pytest.mark.parametrize("route", page_routes())
def test_every_page_post_from_the_anonymous_changes_nothing(demo_cluster, alice, route):
    key, _ = account_services.api_token_create(user=alice, name="ci")
    client = Client()

    response = client.post(concrete(route), {"name": "x"})

    assert response.status_code in (302, 403, 405), (route, response.status_code)
    assert ApiToken.objects.count() == 1 and ApiToken.objects.get().revoked_at is None


@pytest.mark.django_db
def test_the_admin_site_sends_the_anonymous_and_non_staff_to_its_login(alice):
    for client in (Client(), pages_as(alice)):
        response = client.get("/admin/")
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")


def test_the_session_events_socket_refuses_the_anonymous(transactional_db):
    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[GOOD_ORIGIN])
        assert await refused_with(communicator) == CLOSE_UNAUTHENTICATED

    asyncio.run(scenario())


def test_a_terminal_without_a_ticket_is_refused_even_with_the_owners_cookie(transactional_db, alices_session, alice):
    cookie = cookie_of(alice)

    async def scenario():
        communicator = WebsocketCommunicator(application, f"/ws/sessions/{alices_session.pk}/terminal/",
                                             headers=[GOOD_ORIGIN, cookie])
        assert await refused_with(communicator) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


# --- another user: 404, never 403 ---------------------------------------------------------------

SESSION_ACTIONS = [
    ("get", "/api/v1/sessions/{id}/", 200),
    ("get", "/api/v1/sessions/{id}/logs/", 200),
    ("post", "/api/v1/sessions/{id}/terminal-ticket/", 200),
    ("delete", "/api/v1/sessions/{id}/", 202),
]
# Exec needs a live agent to answer the owner: tests/test_api_logs_exec.py covers owner and admin
# (tests/test_exec_stream.py the streamed form, with an agent).
OTHER_USER_ACTIONS = SESSION_ACTIONS + [("post", "/api/v1/sessions/{id}/exec/", 200)]


@pytest.mark.django_db
@pytest.mark.parametrize("method, route, _", OTHER_USER_ACTIONS)
def test_another_users_session_is_a_404_on_every_session_endpoint(alices_session, bob, method, route, _):
    response = getattr(client_for(bob), method)(concrete(route, alices_session.pk), {}, format="json")

    body = assert_error_shape(response, 404)
    assert str(alices_session.pk) not in body["detail"]
    alices_session.refresh_from_db()
    assert alices_session.status == SessionStatus.RUNNING
    assert not alices_session.terminal_tickets.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("method, route, _", OTHER_USER_ACTIONS)
def test_another_users_session_answers_like_a_session_that_does_not_exist(alices_session, bob, method, route, _):
    theirs = getattr(client_for(bob), method)(concrete(route, alices_session.pk), {}, format="json")
    missing = getattr(client_for(bob), method)(concrete(route, uuid.uuid4()), {}, format="json")

    assert (theirs.status_code, theirs.json()) == (missing.status_code, missing.json())


def streamed_exec(session, user) -> str:
    """Start a streamed exec in `session` as `user` (no agent runs: it stays `starting`); its id."""
    response = client_for(user).post(f"/api/v1/sessions/{session.pk}/exec/", {"command": "true", "stream": True},
                                     format="json")
    assert response.status_code == 202, response.content
    return response.json()["id"]


@pytest.mark.django_db
@pytest.mark.parametrize("method", ["get", "delete"])
def test_another_users_streamed_exec_is_a_404_like_one_that_does_not_exist_and_stays_uncancelled(
        alices_session, alice, bob, method):
    exec_id = streamed_exec(alices_session, alice)

    theirs = getattr(client_for(bob), method)(f"/api/v1/sessions/{alices_session.pk}/exec/{exec_id}/")
    missing = getattr(client_for(bob), method)(f"/api/v1/sessions/{uuid.uuid4()}/exec/{uuid.uuid4()}/")

    assert_error_shape(theirs, 404)
    assert (theirs.status_code, theirs.json()) == (missing.status_code, missing.json())
    assert client_for(alice).get(f"/api/v1/sessions/{alices_session.pk}/exec/{exec_id}/").json()["state"] == "starting"


@pytest.mark.django_db
def test_another_users_sessions_are_not_listed_and_their_terminal_page_is_a_404(alices_session, bob):
    assert client_for(bob).get("/api/v1/sessions/").json()["results"] == []
    assert pages_as(bob).get(f"/sessions/{alices_session.pk}/terminal/").status_code == 404
    assert str(alices_session.pk) not in pages_as(bob).get("/sessions/").content.decode()


@pytest.mark.django_db
def test_another_users_token_cannot_be_revoked_404(alice, bob):
    _, token = account_services.api_token_create(user=alice, name="ci")

    assert pages_as(bob).post(f"/account/tokens/{token.pk}/revoke/").status_code == 404

    token.refresh_from_db()
    assert token.revoked_at is None
    assert f'data-token-id="{token.pk}"' not in pages_as(bob).get("/account/").content.decode()


def test_a_terminal_ticket_used_with_another_users_cookie_is_refused(transactional_db, alices_session, alice, bob):
    ticket, _ = services.terminal_ticket_create(session=alices_session, user=alice)
    cookie = cookie_of(bob)

    async def scenario():
        communicator = terminal(alices_session.pk, ticket, GOOD_ORIGIN, cookie)
        assert await refused_with(communicator) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


def test_another_users_session_events_do_not_reach_a_users_socket(transactional_db, alice, bob):
    cookie = cookie_of(bob)

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[GOOD_ORIGIN, cookie])
        assert (await communicator.connect(WS_TIMEOUT))[0] is True
        try:
            from channels.layers import get_channel_layer

            await get_channel_layer().group_send(events.user_group(alice.pk), {
                "type": "session.update", "session": {"id": str(uuid.uuid4()), "status": "RUNNING"}})
            assert await communicator.receive_nothing(timeout=1)
        finally:
            await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.django_db
@pytest.mark.parametrize("method, route", [(m, r) for r in api_routes() for m in WRITE_METHODS
                                           if (m, r) not in USER_WRITABLE_API])
def test_a_user_cannot_write_what_only_administrators_may_change(demo_cluster, alice, method, route):
    """Devices, nodes, slot formats, fractional settings, quotas…: a user's write is refused
    before any validation (403), or the route has no such method (405) or no such object (404).
    What users may write (USER_WRITABLE_API) is checked by the owner and other-user tests."""
    response = getattr(client_for(alice), method)(concrete(route), {}, format="json")

    assert response.status_code in (403, 404, 405), (method, route, response.status_code, response.content[:300])


@pytest.mark.django_db
def test_a_user_cannot_change_a_node(demo_cluster, alice):
    for method in WRITE_METHODS:
        response = getattr(client_for(alice), method)("/api/v1/nodes/demo-node/", {"name": "renamed"}, format="json")
        assert response.status_code in (403, 405), (method, response.status_code)
    assert client_for(alice).get("/api/v1/nodes/demo-node/").json()["name"] == "demo-node"


# --- the owner ----------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("who", ["owner", "admin"])
def test_the_owner_and_an_administrator_may_do_everything_to_a_session(alices_session, alice, admin, who):
    user = alice if who == "owner" else admin
    api = client_for(user)
    for method, route, status in SESSION_ACTIONS:
        response = getattr(api, method)(concrete(route, alices_session.pk), {}, format="json")
        assert response.status_code == status, (method, route, response.content)
    alices_session.refresh_from_db()
    assert alices_session.status == SessionStatus.TERMINATING


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["owner", "admin"])
def test_the_owner_and_an_administrator_start_read_and_cancel_a_streamed_exec(alices_session, alice, admin, who):
    user = alice if who == "owner" else admin
    exec_id = streamed_exec(alices_session, user)
    url = f"/api/v1/sessions/{alices_session.pk}/exec/{exec_id}/"

    read = client_for(user).get(url)
    cancelled = client_for(user).delete(url)

    assert (read.status_code, read.json()["id"]) == (200, exec_id)
    assert (cancelled.status_code, cancelled.json()["state"]) == (200, "cancelled")


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["owner", "admin"])
def test_the_owner_and_an_administrator_see_the_session_and_its_terminal_page(alices_session, alice, admin, who):
    user = alice if who == "owner" else admin

    listed = client_for(user).get("/api/v1/sessions/").json()["results"]
    page = pages_as(user).get(f"/sessions/{alices_session.pk}/terminal/")

    assert str(alices_session.pk) in [s["id"] for s in listed]
    assert page.status_code == 200


@pytest.mark.django_db
def test_every_signed_in_user_reads_the_inventory_and_launch_options(demo_cluster, alice):
    for path in ("/api/v1/nodes/", "/api/v1/nodes/demo-node/", "/api/v1/launch-options/", "/api/v1/sessions/",
                 "/api/v1/mig/profiles/", "/api/v1/mig/layouts/", "/api/v1/nodes/demo-node/mig/"):
        assert client_for(alice).get(path).status_code == 200, path


@pytest.mark.django_db
def test_every_page_opens_for_a_signed_in_user(demo_cluster, alice):
    for path in ("/", "/sessions/", "/account/"):
        assert pages_as(alice).get(path).status_code in (200, 302), path


@pytest.mark.parametrize("who", ["owner", "admin"])
def test_the_owner_and_an_administrator_open_the_terminal_websocket(transactional_db, alices_session, alice, admin, who):
    user = alice if who == "owner" else admin
    ticket, _ = services.terminal_ticket_create(session=alices_session, user=user)
    cookie = cookie_of(user)

    async def scenario():
        communicator = terminal(alices_session.pk, ticket, GOOD_ORIGIN, cookie)
        assert (await communicator.connect(WS_TIMEOUT))[0] is True
        await communicator.disconnect()

    asyncio.run(scenario())


# --- CSRF on pages ------------------------------------------------------------------------------

def csrf_client(user) -> tuple[Client, str]:
    """A signed-in client that enforces CSRF, and the token its pages carry."""
    client = pages_as(user, enforce_csrf_checks=True)
    client.get("/account/")
    return client, client.cookies["csrftoken"].value


@pytest.mark.django_db
def test_creating_a_token_needs_the_csrf_token(alice):
    client, csrf = csrf_client(alice)

    assert client.post("/account/tokens/", {"name": "ci"}).status_code == 403
    assert not ApiToken.objects.exists()
    assert client.post("/account/tokens/", {"name": "ci", "csrfmiddlewaretoken": csrf}).status_code == 303
    assert ApiToken.objects.filter(user=alice, name="ci").exists()


@pytest.mark.django_db
def test_revoking_a_token_needs_the_csrf_token(alice):
    _, token = account_services.api_token_create(user=alice, name="ci")
    account_services.login_token_issue(user=alice)
    client, csrf = csrf_client(alice)

    assert client.post(f"/account/tokens/{token.pk}/revoke/").status_code == 403
    assert client.post("/account/login-token/revoke/").status_code == 403
    token.refresh_from_db()
    assert token.revoked_at is None
    assert LoginToken.objects.filter(user=alice).exists()

    assert client.post(f"/account/tokens/{token.pk}/revoke/", {"csrfmiddlewaretoken": csrf}).status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None


@pytest.mark.django_db
def test_logging_out_needs_the_csrf_token(alice):
    client, csrf = csrf_client(alice)

    assert client.post("/logout/").status_code == 403
    assert client.get("/account/").status_code == 200  # still signed in
    assert client.post("/logout/", {"csrfmiddlewaretoken": csrf}).status_code == 302
    assert client.get("/account/").status_code == 302


@pytest.mark.django_db
def test_logging_in_needs_the_csrf_token(django_user_model):
    django_user_model.objects.create_user("carol", password="a-long-test-password")
    client = Client(enforce_csrf_checks=True)

    response = client.post("/login/", {"username": "carol", "password": "a-long-test-password"})

    assert response.status_code == 403


@pytest.mark.django_db
def test_api_writes_with_the_session_cookie_need_the_csrf_header_but_token_auth_does_not(demo_cluster, alice):
    client, csrf = csrf_client(alice)
    body = {"name": "s", "resources": {"cuda.shares": "0.5"}}

    refused = client.post("/api/v1/sessions/", body, content_type="application/json")
    accepted = client.post("/api/v1/sessions/", body, content_type="application/json", HTTP_X_CSRFTOKEN=csrf)
    by_token = client_for(alice).post("/api/v1/sessions/", {**body, "name": "s2"}, format="json")

    assert_error_shape(refused, 403)
    assert "CSRF" in refused.json()["detail"]
    assert accepted.status_code == 201, accepted.content
    assert by_token.status_code == 201, by_token.content
    assert ComputeSession.objects.filter(owner=alice).count() == 2


# --- websocket origins --------------------------------------------------------------------------

def cookie_of(user) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    return b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()


def terminal(session_id, ticket: str, *headers) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, f"/ws/sessions/{session_id}/terminal/?ticket={ticket}",
                                 headers=list(headers))


async def refused_with(communicator: WebsocketCommunicator) -> int:
    """The close code of a refused connection (closed before the handshake, or accepted and
    closed at once with an application code)."""
    connected, code = await communicator.connect(WS_TIMEOUT)
    if connected:
        message = await communicator.receive_output(WS_TIMEOUT)
        assert message["type"] == "websocket.close", f"expected a refusal, got {message}"
        code = message.get("code", 1000)
    return code


@pytest.mark.parametrize("origin", [b"http://evil.example", b"http://localhost.evil.example",
                                    b"https://evil.example:8000", b"null"])
def test_the_session_events_socket_refuses_a_foreign_origin_even_with_a_valid_cookie(transactional_db, alice, origin):
    cookie = cookie_of(alice)

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[(b"origin", origin), cookie])
        connected, _ = await communicator.connect(WS_TIMEOUT)
        assert connected is False  # refused before the handshake: nothing reaches the consumer

    asyncio.run(scenario())


@pytest.mark.parametrize("origin", [b"http://evil.example", b"http://127.0.0.1.evil.example"])
def test_a_terminal_refuses_a_foreign_origin_and_the_ticket_stays_unspent(transactional_db, alices_session, alice, origin):
    ticket, row = services.terminal_ticket_create(session=alices_session, user=alice)
    cookie = cookie_of(alice)

    async def scenario():
        communicator = terminal(alices_session.pk, ticket, (b"origin", origin), cookie)
        connected, _ = await communicator.connect(WS_TIMEOUT)
        assert connected is False

    asyncio.run(scenario())
    row.refresh_from_db()
    assert row.used_at is None


@pytest.mark.parametrize("origin", [b"http://localhost:8000", b"http://127.0.0.1:8000", b"https://localhost"])
def test_the_consoles_own_origins_are_let_through(transactional_db, alice, origin):
    cookie = cookie_of(alice)

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[(b"origin", origin), cookie])
        assert (await communicator.connect(WS_TIMEOUT))[0] is True
        await communicator.disconnect()

    asyncio.run(scenario())
