"""The REST API (`/api/v1/`) and the two pages, through the real URLconf, token auth and the
one error shape `{"type", "title", "detail", "field_errors"}`."""
from __future__ import annotations

import json
import re

import pytest
from accounts.models import LoginToken
from accounts.selectors import api_token_digest
from rest_framework.test import APIClient

from sessions.lifecycle import services
from sessions.models import ComputeSession, SessionStatus
from tests.conftest import assert_error_shape, client_for, make_running

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(alice):
    return client_for(alice)


@pytest.fixture
def launch(django_capture_on_commit_callbacks):
    """POST a session and run its on-commit scheduling, as the manager worker would."""

    def launch(client, resources=None, **body):
        with django_capture_on_commit_callbacks(execute=True):
            return client.post("/api/v1/sessions/", {"name": "s", "resources": resources or {"cuda.shares": "0.5"},
                                                     **body}, format="json")

    return launch


# --- authentication ---------------------------------------------------------------------------

def test_a_user_gets_an_api_token_for_their_password_and_it_authenticates(demo_cluster, django_user_model):
    user = django_user_model.objects.create_user("carol", password="s3cret-pass")

    response = APIClient().post("/api/v1/auth/token/", {"username": "carol", "password": "s3cret-pass"}, format="json")

    assert response.status_code == 200, response.content
    token = response.json()["token"]
    assert LoginToken.objects.get(user=user).digest == api_token_digest(token)  # stored hashed
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/sessions/").status_code == 200


def test_a_wrong_password_gets_no_token(demo_cluster, django_user_model):
    django_user_model.objects.create_user("carol", password="s3cret-pass")

    response = APIClient().post("/api/v1/auth/token/", {"username": "carol", "password": "nope"}, format="json")

    body = assert_error_shape(response, 400)
    assert not LoginToken.objects.exists()
    assert body["field_errors"]


@pytest.mark.parametrize("method, path", [
    ("get", "/api/v1/sessions/"),
    ("post", "/api/v1/sessions/"),
    ("get", "/api/v1/nodes/"),
    ("get", "/api/v1/launch-options/"),
])
def test_unauthenticated_requests_get_401_in_the_error_shape(demo_cluster, method, path):
    response = getattr(APIClient(), method)(path, format="json")

    body = assert_error_shape(response, 401)
    assert body["title"] == "Not authenticated"
    assert response["WWW-Authenticate"].startswith("Token")


def test_a_bad_token_gets_401(demo_cluster):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")

    assert_error_shape(client.get("/api/v1/sessions/"), 401)


# --- sessions -----------------------------------------------------------------------------------

def test_launching_half_an_fgpu_answers_201_with_the_session_and_its_configuration(demo_cluster, api, alice):
    response = api.post("/api/v1/sessions/", {"name": "notebook", "resources": {"cuda.shares": "0.5"}}, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    session = ComputeSession.objects.get(pk=body["id"])
    assert session.owner == alice
    assert body["status"] == "PENDING"
    assert body["name"] == "notebook"
    assert body["owner"] == "alice"
    assert body["configuration"] == "0.50 fGPU · 1 core · 1 GiB"
    assert body["terminal_url"] == f"/sessions/{session.pk}/terminal/"


def test_a_launched_session_is_scheduled_and_shows_its_allocation(demo_cluster, api, launch):
    created = launch(api).json()

    body = api.get(f"/api/v1/sessions/{created['id']}/").json()

    assert body["status"] == "SCHEDULED"
    assert body["node"] == "demo-node"
    [allocation] = body["allocations"]
    assert allocation["shares"] == "0.500"
    assert allocation["memory"] == 2 << 30
    assert allocation["procs"] == "20.000"
    assert allocation["device"] == "GPU-00000000-0000-0000-0000-000000000000"


def test_a_request_larger_than_any_node_is_a_400_naming_the_slot_and_the_maximum(demo_cluster, api):
    response = api.post("/api/v1/sessions/", {"resources": {"cuda.shares": "3"}}, format="json")

    body = assert_error_shape(response, 400)
    assert "cuda.shares" in body["detail"]
    assert "2.00 fGPU" in body["detail"]
    assert body["field_errors"]["resources"] == [body["detail"]]
    assert not ComputeSession.objects.exists()


def test_a_request_off_the_quantum_is_a_400_with_a_resources_field_error(demo_cluster, api):
    response = api.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.3"}}, format="json")

    body = assert_error_shape(response, 400)
    assert "quantum" in body["detail"]
    assert "resources" in body["field_errors"]


def test_a_request_without_resources_is_a_400_with_field_errors(demo_cluster, api):
    response = api.post("/api/v1/sessions/", {"name": "x"}, format="json")

    body = assert_error_shape(response, 400)
    assert "resources" in body["field_errors"]
    assert not ComputeSession.objects.exists()


def test_users_list_only_their_own_sessions(demo_cluster, alice, bob, launch):
    mine = launch(client_for(alice)).json()["id"]
    launch(client_for(bob))

    body = client_for(alice).get("/api/v1/sessions/").json()

    assert [s["id"] for s in body["results"]] == [mine]


def test_staff_see_every_session(demo_cluster, alice, bob, staff, launch):
    ids = {launch(client_for(alice)).json()["id"], launch(client_for(bob)).json()["id"]}

    body = client_for(staff).get("/api/v1/sessions/").json()

    assert {s["id"] for s in body["results"]} == ids
    for session_id in ids:
        assert client_for(staff).get(f"/api/v1/sessions/{session_id}/").status_code == 200


def test_another_users_session_is_404_on_get_delete_and_terminal_ticket_never_403(demo_cluster, alice, bob, launch):
    session_id = launch(client_for(bob)).json()["id"]
    make_running(session_id)
    path = f"/api/v1/sessions/{session_id}/"
    api = client_for(alice)

    assert_error_shape(api.get(path), 404)
    assert_error_shape(api.delete(path), 404)
    assert_error_shape(api.post(path + "terminal-ticket/"), 404)

    session = ComputeSession.objects.get(pk=session_id)
    assert session.status == SessionStatus.RUNNING
    assert not session.terminal_tickets.exists()


def test_an_unknown_session_id_is_404(demo_cluster, api):
    assert_error_shape(api.get("/api/v1/sessions/00000000-0000-0000-0000-000000000000/"), 404)


def test_a_malformed_session_id_is_404_not_a_server_error(demo_cluster, api):
    assert_error_shape(api.get("/api/v1/sessions/not-a-uuid/"), 404)
    assert_error_shape(api.delete("/api/v1/sessions/not-a-uuid/"), 404)


def test_deleting_a_pending_session_cancels_it_with_202(demo_cluster, api):
    session_id = api.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}}, format="json").json()["id"]

    response = api.delete(f"/api/v1/sessions/{session_id}/")

    assert response.status_code == 202, response.content
    assert response.json()["status"] == "CANCELLED"


def test_deleting_a_running_session_answers_202_terminating(demo_cluster, api, launch, django_capture_on_commit_callbacks):
    session_id = launch(api).json()["id"]
    make_running(session_id)

    with django_capture_on_commit_callbacks(execute=True):  # the stop task fails: no agent here
        response = api.delete(f"/api/v1/sessions/{session_id}/")

    assert response.status_code == 202, response.content
    assert response.json()["status"] == "TERMINATING"


def test_the_owner_gets_a_terminal_ticket_for_a_running_session(demo_cluster, api, launch):
    session_id = launch(api).json()["id"]
    make_running(session_id)

    response = api.post(f"/api/v1/sessions/{session_id}/terminal-ticket/")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["url"] == f"/ws/sessions/{session_id}/terminal/?ticket={body['ticket']}"
    assert body["expires_at"]
    assert services.terminal_ticket_redeem(session_id=session_id, ticket=body["ticket"]).pk.hex == session_id.replace("-", "")


def test_a_terminal_ticket_for_a_session_not_yet_running_is_409(demo_cluster, api, launch):
    session_id = launch(api).json()["id"]

    body = assert_error_shape(api.post(f"/api/v1/sessions/{session_id}/terminal-ticket/"), 409)

    assert "SCHEDULED" in body["detail"]


def test_sessions_can_be_filtered_by_status(demo_cluster, api, launch):
    scheduled = launch(api).json()["id"]
    api.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}}, format="json")  # stays PENDING

    body = api.get("/api/v1/sessions/?status=scheduled").json()

    assert [s["id"] for s in body["results"]] == [scheduled]


# --- nodes and launch options -----------------------------------------------------------------

def device_of(api, node="demo-node") -> dict:
    body = api.get("/api/v1/nodes/").json()
    [found] = [n for n in body["results"] if n["name"] == node]
    [device] = found["devices"]
    return device


def test_nodes_show_each_devices_capacity_allocated_and_free_fgpu(demo_cluster, api, launch):
    device = device_of(api)
    assert (device["capacity_fgpu"], device["allocated_fgpu"], device["free_fgpu"]) == ("2.00", "0.00", "2.00")

    launch(api)

    device = device_of(api)
    assert (device["capacity_fgpu"], device["allocated_fgpu"], device["free_fgpu"]) == ("2.00", "0.50", "1.50")
    assert device["memory_size"] == 8 << 30
    assert device["subproc_count"] == 80


def test_a_node_is_found_by_its_name(demo_cluster, api):
    response = api.get("/api/v1/nodes/demo-node/")

    assert response.status_code == 200
    assert response.json()["devices"][0]["capacity_fgpu"] == "2.00"


def test_launch_options_offer_the_quantum_as_min_and_step_and_the_largest_amounts(demo_cluster, api, launch):
    [slot] = api.get("/api/v1/launch-options/").json()["slots"]
    assert slot["slot"] == "cuda.shares"
    assert (slot["min"], slot["step"]) == ("0.25", "0.25")
    assert (slot["max_now"], slot["max_ever"]) == ("2.00", "2.00")

    launch(api, {"cuda.shares": "1.5"})

    body = api.get("/api/v1/launch-options/").json()
    [slot] = body["slots"]
    assert (slot["max_now"], slot["max_ever"]) == ("0.50", "2.00")
    assert body["cpu"] == {"max_now": 7, "max_ever": 8}


# --- pages --------------------------------------------------------------------------------------

def test_the_session_page_requires_login(demo_cluster, client):
    response = client.get("/sessions/")

    assert response.status_code == 302
    assert response["Location"].startswith("/login/")
    assert "next=/sessions/" in response["Location"]


def test_the_session_page_renders_the_launch_options_for_a_signed_in_user(demo_cluster, client, alice, launch):
    mine = launch(client_for(alice)).json()["id"]
    client.force_login(alice)

    response = client.get("/sessions/")

    assert response.status_code == 200
    html = response.content.decode()
    options = json.loads(re.search(r'<script id="launch-options" type="application/json">(.*?)</script>', html, re.S)[1])
    [slot] = options["slots"]
    assert (slot["min"], slot["max_now"], slot["max_ever"]) == ("0.25", "1.50", "2.00")
    sessions = json.loads(re.search(r'<script id="initial-sessions" type="application/json">(.*?)</script>', html, re.S)[1])
    assert [s["id"] for s in sessions] == [mine]


def page_state(response) -> dict:
    html = response.content.decode()
    return json.loads(re.search(r'<script id="list-state" type="application/json">(.*?)</script>', html, re.S)[1])


def test_the_session_page_opens_on_the_tab_filters_and_page_its_address_names(demo_cluster, client, alice, bob,
                                                                               staff, launch):
    ids = [launch(client_for(alice), name="").json()["id"] for _ in range(27)]
    ComputeSession.objects.filter(pk__in=ids[:3]).update(status=SessionStatus.CANCELLED)
    launch(client_for(bob))
    client.force_login(staff)

    state = page_state(client.get("/sessions/"))
    assert state["filters"] == {"tab": "all", "status": "", "owner": "", "node": "", "page": 1}
    assert (state["count"], state["page_size"], state["show_owner"]) == (28, 25, True)
    assert state["owners"] == ["alice", "bob"] and state["nodes"] == ["demo-node"]
    assert state["default_name"] == "session-1"  # the staff user's own next name

    response = client.get("/sessions/?tab=running&owner=alice&page=2")
    state = page_state(response)
    assert state["filters"]["page"] == 1  # past the last page (24 rows): the last
    assert state["count"] == 24
    assert response.content.count(b'<tr data-session-id="') == 24
    assert b'<th scope="col" class="owner-heading">Owner</th>' in response.content

    state = page_state(client.get("/sessions/?tab=finished&status=running&node=%00&page=x"))
    assert state["filters"] == {"tab": "finished", "status": "", "owner": "", "node": "", "page": 1}
    assert state["count"] == 3

    client.force_login(alice)  # not an administrator: no owners, and an owner filter is ignored
    response = client.get("/sessions/?owner=bob")
    state = page_state(response)
    assert (state["show_owner"], state["owners"], state["filters"]["owner"], state["count"]) == (False, [], "", 27)
    assert state["default_name"] == "session-28"
    assert b"owner-heading" not in response.content


def test_terminating_through_the_api_says_who_asked(demo_cluster, alice, staff, launch):
    session_id = launch(client_for(alice)).json()["id"]
    make_running(session_id)

    body = client_for(staff).delete(f"/api/v1/sessions/{session_id}/").json()

    assert (body["status"], body["status_reason"]) == ("TERMINATING", f"at the request of {staff.username}")


def test_the_terminal_page_of_another_users_session_is_404(demo_cluster, client, alice, bob, launch):
    session_id = launch(client_for(bob)).json()["id"]
    client.force_login(alice)

    assert client.get(f"/sessions/{session_id}/terminal/").status_code == 404


def test_the_owner_sees_their_sessions_terminal_page(demo_cluster, client, alice, launch):
    session_id = launch(client_for(alice)).json()["id"]
    client.force_login(alice)

    response = client.get(f"/sessions/{session_id}/terminal/")

    assert response.status_code == 200
    assert "0.50 fGPU · 1 core · 1 GiB" in response.content.decode()
