"""GET /api/v1/sessions/<id>/logs/ and POST /api/v1/sessions/<id>/exec/: who may call them, the
log's cursor (sequence order, retries stored once, the size cap), and exec through a real
agent listening on the Redis channel layer (as on a GPU node) in a thread of this process."""
from __future__ import annotations

import asyncio
import threading

import pytest
from django.conf import settings
from django.test import override_settings
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import SessionLogChunk, SessionStatus
from agent.core import Agent
from protocol.messages import StartSpec
from common.exec_store import exec_store_default
from tests.conftest import GiB, assert_error_shape, client_for, mock_gpu, wait_until
from tests.test_agent_runtime import start_spec

pytestmark = pytest.mark.django_db


def ship(session, *batches, final_last: bool = False):
    """Store batches (seq, text) as the agent would ship them, offsets running on."""
    offset = 0
    for i, (seq, text) in enumerate(batches):
        final = final_last and i == len(batches) - 1
        services.session_log_append(session_id=str(session.pk), seq=seq, offset=offset, text=text, final=final)
        offset += len(text)


def end(session, status=SessionStatus.TERMINATED):
    assert services.session_report_apply(session_id=str(session.pk), status=status, exit_code=0)


# --- logs: who ------------------------------------------------------------------------------------

def test_the_owner_and_an_administrator_read_a_sessions_log(alices_session, alice, staff):
    ship(alices_session, (0, "hello\r\n"))

    for user in (alice, staff):
        body = client_for(user).get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()
        assert body == {"text": "hello\r\n", "start": 0, "next": 7, "length": 7, "truncated": False,
                        "complete": False}


def test_another_user_gets_a_404_and_the_anonymous_a_401_for_a_log(alices_session, bob):
    ship(alices_session, (0, "secret"))

    assert_error_shape(client_for(bob).get(f"/api/v1/sessions/{alices_session.pk}/logs/"), 404)
    assert_error_shape(client_for(None).get(f"/api/v1/sessions/{alices_session.pk}/logs/"), 401)


def test_a_negative_empty_or_non_numeric_cursor_is_a_400_naming_since(alices_session, alice):
    for since in ("-1", "x", ""):
        body = assert_error_shape(client_for(alice).get(f"/api/v1/sessions/{alices_session.pk}/logs/?since={since}"), 400)
        assert list(body["field_errors"]) == ["since"]


# --- logs: the cursor ---------------------------------------------------------------------------

def test_reading_from_next_returns_only_what_came_after(alices_session, alice):
    api = client_for(alice)
    ship(alices_session, (0, "one\n"))
    first = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()
    services.session_log_append(session_id=str(alices_session.pk), seq=1, offset=4, text="two\n")

    second = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/?since={first['next']}").json()

    assert (first["text"], second["text"], second["start"], second["next"]) == ("one\n", "two\n", 4, 8)


def test_a_cursor_inside_a_batch_starts_mid_batch(alices_session, alice):
    ship(alices_session, (0, "abcdef"))

    body = client_for(alice).get(f"/api/v1/sessions/{alices_session.pk}/logs/?since=2&limit=3").json()

    assert (body["text"], body["start"], body["next"]) == ("cde", 2, 5)


def test_a_batch_delivered_twice_is_stored_once(alices_session):
    ship(alices_session, (0, "once\n"))

    again = services.session_log_append(session_id=str(alices_session.pk), seq=0, offset=0, text="once\n")

    assert again is False
    assert SessionLogChunk.objects.filter(session=alices_session).count() == 1


def test_a_batch_still_in_flight_holds_back_the_ones_after_it(alices_session, alice):
    services.session_log_append(session_id=str(alices_session.pk), seq=0, offset=0, text="a\n")
    services.session_log_append(session_id=str(alices_session.pk), seq=2, offset=4, text="c\n")  # seq 1 not yet here
    api = client_for(alice)

    before = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()
    services.session_log_append(session_id=str(alices_session.pk), seq=1, offset=2, text="b\n")
    after = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/?since={before['next']}").json()

    assert (before["text"], before["next"]) == ("a\n", 2)
    assert (after["text"], after["next"]) == ("b\nc\n", 6)


def test_the_log_survives_the_session_and_says_complete_once_the_last_batch_is_in(alices_session, alice):
    api = client_for(alice)
    ship(alices_session, (0, "done\n"))
    end(alices_session)

    waiting = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()
    services.session_log_append(session_id=str(alices_session.pk), seq=1, offset=5, text="", final=True)
    finished = api.get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()

    assert (waiting["text"], waiting["complete"]) == ("done\n", False)
    assert (finished["text"], finished["complete"]) == ("done\n", True)


def test_a_session_cancelled_before_it_ran_has_an_empty_complete_log(demo_cluster, alice):
    session = admission.session_create(owner=alice, name="never", resources={"cuda.shares": "0.5"})
    services.session_terminate(session=session)

    body = client_for(alice).get(f"/api/v1/sessions/{session.pk}/logs/").json()

    assert body == {"text": "", "start": 0, "next": 0, "length": 0, "truncated": False, "complete": True}


@override_settings(FGPU_SESSION_LOG_MAX_CHARS=10)
def test_only_the_last_characters_up_to_the_cap_are_kept_and_an_old_cursor_says_truncated(alices_session, alice):
    ship(alices_session, (0, "0123"), (1, "4567"), (2, "89ab"), (3, "cdef"))

    body = client_for(alice).get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()

    assert body["truncated"] is True
    assert body["text"] == "456789abcdef" and body["start"] == 4 and body["next"] == 16


def test_nul_characters_are_stored_as_replacement_characters(alices_session, alice):
    ship(alices_session, (0, "a\x00b"))

    assert client_for(alice).get(f"/api/v1/sessions/{alices_session.pk}/logs/").json()["text"] == "a\ufffdb"


# --- exec ---------------------------------------------------------------------------------------

class QuietManager:
    """An agent's manager that records reports only (the test applies what it needs itself)."""

    def __init__(self):
        self.reports = []

    def register(self, *args):
        pass

    def heartbeat(self, *args):
        pass

    def report(self, session_id, status, reason, exit_code):
        self.reports.append((session_id, status))

    def log(self, *args):
        pass


def agent_in_thread(tmp_path, **options):
    """A started Agent for demo-node (scratch under tmp_path; `options`: more Agent arguments) on
    its own event loop in a daemon thread, on the Redis channel layer: (agent, its QuietManager,
    the loop, the thread)."""
    from channels_redis.core import RedisChannelLayer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    layer = RedisChannelLayer(hosts=[{"address": settings.REDIS_URL, "socket_timeout": None}])
    manager = QuietManager()
    inventory = {"devices": [mock_gpu(0).as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8,
                 "memory_size": 32 * GiB}
    agent = Agent(node="demo-node", inventory=inventory, channel_layer=layer, manager=manager,
                  scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=60,
                  exec_store=exec_store_default(), **options)
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(10)
    return agent, manager, loop, thread


@pytest.fixture
def demo_agent(tmp_path):
    """A real Agent for demo-node on its own event loop in a thread, on the Redis channel layer."""
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL: the agent and the web share the channel layer across event loops")
    agent, manager, loop, thread = agent_in_thread(tmp_path)

    def run(session):
        spec = start_spec(command="sleep 60")
        spec["session_id"] = str(session.pk)
        agent.submit_start(StartSpec.decode(spec))
        wait_until(lambda: (str(session.pk), "RUNNING") in manager.reports, timeout=10, what="the agent's RUNNING")

    yield run
    asyncio.run_coroutine_threadsafe(agent.shutdown(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_the_owner_and_an_administrator_exec_nvidia_smi_and_see_the_sessions_slice(alices_session, alice, staff,
                                                                                    demo_agent):
    demo_agent(alices_session)

    for user in (alice, staff):
        response = client_for(user).post(f"/api/v1/sessions/{alices_session.pk}/exec/",
                                         {"command": ["nvidia-smi"], "timeout": 20}, format="json")
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["exit_code"] == 0 and "2048MiB" in body["stdout"], body


def test_exec_answers_a_shell_lines_status_stdout_and_stderr(alices_session, alice, demo_agent):
    demo_agent(alices_session)

    body = client_for(alice).post(f"/api/v1/sessions/{alices_session.pk}/exec/",
                                  {"command": "echo $FGPU_SESSION_ID; echo bad >&2; exit 3"}, format="json").json()

    assert (body["exit_code"], body["stdout"], body["stderr"]) == (3, f"{alices_session.pk}\n", "bad\n")


def test_a_command_past_its_timeout_is_killed_and_answered_504(alices_session, alice, demo_agent):
    demo_agent(alices_session)

    response = client_for(alice).post(f"/api/v1/sessions/{alices_session.pk}/exec/",
                                      {"command": "sleep 20", "timeout": 1}, format="json")

    body = assert_error_shape(response, 504)
    assert body["type"] == "exec-timeout" and "timeout of 1 s" in body["detail"]


def test_exec_on_a_session_no_agent_answers_for_is_a_504_naming_the_node(alices_session, alice, monkeypatch):
    monkeypatch.setattr(services, "EXEC_REPLY_GRACE_S", 0.2)

    response = client_for(alice).post(f"/api/v1/sessions/{alices_session.pk}/exec/",
                                      {"command": ["true"], "timeout": 1}, format="json")

    body = assert_error_shape(response, 504)
    assert "demo-node did not answer" in body["detail"]


def test_exec_on_a_session_that_is_not_running_is_a_409(alices_session, alice):
    end(alices_session)

    response = client_for(alice).post(f"/api/v1/sessions/{alices_session.pk}/exec/", {"command": ["true"]}, format="json")

    assert assert_error_shape(response, 409)["type"] == "session-not-running"


@pytest.mark.parametrize("body, field", [
    ({}, "command"), ({"command": []}, "command"), ({"command": ""}, "command"), ({"command": [1]}, "command"),
    ({"command": ["true"], "timeout": 0}, "timeout"), ({"command": ["true"], "timeout": 100000}, "timeout"),
])
def test_a_malformed_exec_request_is_a_400_naming_the_field(alices_session, alice, body, field):
    response = client_for(alice).post(f"/api/v1/sessions/{alices_session.pk}/exec/", body, format="json")

    assert list(assert_error_shape(response, 400)["field_errors"]) == [field]


def test_another_user_gets_a_404_and_the_anonymous_a_401_for_exec(alices_session, bob):
    for user, status in ((bob, 404), (None, 401)):
        response = client_for(user).post(f"/api/v1/sessions/{alices_session.pk}/exec/", {"command": ["true"]},
                                         format="json")
        assert_error_shape(response, status)
