"""Streamed exec: `POST /api/v1/sessions/<id>/exec/` with `"stream": true` (202 and an id),
`GET …/exec/<exec_id>/?since=` (output while it runs), `DELETE …/exec/<exec_id>/` (kill it).

A real agent listens on the Redis channel layer in a thread of this process (as on a GPU node)
and pushes output to the real Redis exec store; the web side is the API through DRF's client.
The stores themselves are checked against Redis and against the standalone memory store."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from django.conf import settings
from django.test import override_settings
from sessions.lifecycle import services
from sessions.admission import launch as admission
from common.exec_store import exec_store_default
from protocol.exec_store import MemoryExecStore, RedisExecStore, record_id
from tests.conftest import assert_error_shape, client_for, wait_until, wait_until_async
from tests.test_agent_runtime import run_agent, start_spec
from tests.test_api_logs_exec import demo_agent, end  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def exec_url(session, exec_id=None) -> str:
    return f"/api/v1/sessions/{session.pk}/exec/" + (f"{exec_id}/" if exec_id else "")


def stream(api, session, command, timeout: int = 30) -> dict:
    response = api.post(exec_url(session), {"command": command, "timeout": timeout, "stream": True}, format="json")
    assert response.status_code == 202, response.content
    body = response.json()
    assert response["Location"] == exec_url(session, body["id"])
    return body


def read(api, session, exec_id, since: int = 0) -> dict:
    response = api.get(exec_url(session, exec_id), {"since": since})
    assert response.status_code == 200, response.content
    return response.json()


def follow(api, session, exec_id) -> tuple[dict, list[tuple[str, str]]]:
    """Read from 0 until complete: the last read and every chunk as (stream, data)."""
    chunks, since = [], 0

    def step():
        nonlocal since
        body = read(api, session, exec_id, since)
        chunks.extend((c["stream"], c["data"]) for c in body["chunks"])
        since = body["next"]
        return body if body["complete"] else None

    return wait_until(step, timeout=30, interval=0.05, what="the exec to complete"), chunks


def text_of(chunks, name: str) -> str:
    return "".join(data for stream, data in chunks if stream == name)


def live_in_session(api, session, pids: list[int]) -> list[int]:
    """Which of `pids` (as the session sees them: a sandboxed session has a PID namespace of its
    own) live, asked the way its user would: `kill -0` in an exec beside it."""
    command = f"for p in {' '.join(map(str, pids))}; do kill -0 $p 2>/dev/null && echo $p; done; true"
    response = api.post(exec_url(session), {"command": command, "timeout": 20}, format="json")
    assert response.status_code == 200, response.content
    return [int(line) for line in response.json()["stdout"].split()]


@pytest.fixture
def work_dir(tmp_path, alices_session):
    """The session's working directory on demo_agent's node (the agent runs in this process)."""
    return tmp_path / "scratch" / str(alices_session.pk)


# --- streaming ------------------------------------------------------------------------------------

def test_a_streamed_exec_answers_202_at_once_and_shows_output_before_the_command_ends(
        alices_session, alice, demo_agent, work_dir):
    demo_agent(alices_session)
    api = client_for(alice)

    # It prints, then waits for a file only this test creates: it cannot end before the test says.
    started = stream(api, alices_session, "echo first; echo warn >&2; until [ -e go ]; do sleep 0.05; done; "
                                          "echo second; exit 3")
    assert (started["state"], started["running"], started["exit_code"]) == ("starting", True, None)
    assert started["command"].startswith("echo first") and started["timeout"] == 30

    partial = wait_until(lambda: (body := read(api, alices_session, started["id"])) and len(body["chunks"]) >= 2
                         and body, timeout=20, interval=0.05, what="the first output")
    (work_dir / "go").touch()
    final, rest = follow(api, alices_session, started["id"])

    assert (partial["state"], partial["running"], partial["complete"], partial["exit_code"]) == (
        "running", True, False, None)
    assert sorted((c["stream"], c["data"]) for c in partial["chunks"]) == [("stderr", "warn\n"), ("stdout", "first\n")]
    assert partial["next"] == len(partial["chunks"])
    assert (final["state"], final["running"], final["exit_code"], final["cancelled"], final["timed_out"]) == (
        "exited", False, 3, False, False)
    assert final["duration_ms"] >= 0 and final["error"] == "" and final["truncated"] is False
    assert text_of(rest, "stdout") == "first\nsecond\n" and text_of(rest, "stderr") == "warn\n"


def test_reading_from_next_returns_only_what_came_after_in_order_with_its_stream(alices_session, alice, demo_agent):
    demo_agent(alices_session)
    api = client_for(alice)
    started = stream(api, alices_session, "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three")

    final, chunks = follow(api, alices_session, started["id"])
    again = read(api, alices_session, started["id"], since=final["next"])
    whole = read(api, alices_session, started["id"])

    assert chunks == [("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
    assert (again["chunks"], again["next"], again["complete"]) == ([], final["next"], True)
    assert [(c["stream"], c["data"]) for c in whole["chunks"]] == chunks


def test_one_read_returns_about_its_byte_limit_and_next_moves_on(alices_session, alice, monkeypatch):
    monkeypatch.setattr(services, "EXEC_READ_MAX_BYTES", 10)
    api = client_for(alice)
    started = stream(api, alices_session, "true")  # no agent: it stays `starting`
    exec_store_default().append(record_id(alices_session.node.name, started["id"]), [("o", "abcdef"), ("e", "ghijkl"), ("o", "mn")])

    first = read(api, alices_session, started["id"])
    second = read(api, alices_session, started["id"], since=first["next"])

    assert [c["data"] for c in first["chunks"]] == ["abcdef"] and first["next"] == 1
    assert [c["data"] for c in second["chunks"]] == ["ghijkl", "mn"] and second["next"] == 3
    assert second["complete"] is False  # still starting


def test_a_command_past_its_timeout_is_killed_and_reported_timed_out_with_its_output(alices_session, alice,
                                                                                     demo_agent):
    demo_agent(alices_session)
    api = client_for(alice)
    started = stream(api, alices_session, "echo started; sleep 30", timeout=1)

    final, chunks = follow(api, alices_session, started["id"])

    assert (final["state"], final["timed_out"], final["exit_code"]) == ("timed_out", True, 128 + 9)
    assert chunks == [("stdout", "started\n")]


@override_settings(FGPU_EXEC_STREAM_MAX_BYTES=999)
def test_each_stream_is_cut_at_the_cap_on_a_character_boundary_and_the_command_runs_to_its_end(
        alices_session, alice, demo_agent):
    demo_agent(alices_session)
    api = client_for(alice)
    # 5,000 bytes of "x" on stdout; 600 two-byte "é" (1,200 bytes) on stderr; then a marker past the cap.
    started = stream(api, alices_session, "head -c 5000 /dev/zero | tr '\\0' x; "
                                          "for i in $(seq 600); do printf '\\303\\251'; done >&2; echo end; exit 7")

    final, chunks = follow(api, alices_session, started["id"])

    assert final["truncated"] is True and final["exit_code"] == 7
    assert text_of(chunks, "stdout") == "x" * 999  # the marker came after the cap: dropped
    assert text_of(chunks, "stderr") == "é" * 499  # 998 bytes: the 500th character would not fit whole


# --- cancel ---------------------------------------------------------------------------------------

def test_delete_kills_the_command_and_everything_it_started_and_the_result_says_cancelled(
        alices_session, alice, demo_agent, work_dir):
    demo_agent(alices_session)
    api = client_for(alice)
    started = stream(api, alices_session, "sleep 60 & echo $! > child; echo $$ > pid; echo started; wait", timeout=120)
    wait_until(lambda: read(api, alices_session, started["id"])["chunks"], timeout=20, interval=0.05,
               what="the command to start")
    pids = [int((work_dir / name).read_text()) for name in ("pid", "child")]
    assert live_in_session(api, alices_session, pids) == pids

    response = api.delete(exec_url(alices_session, started["id"]))

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["state"], body["cancelled"], body["running"], body["exit_code"]) == ("cancelled", True, False, 128 + 15)
    assert "chunks" not in body
    wait_until(lambda: not live_in_session(api, alices_session, pids), timeout=10, what="the command's processes to be gone")
    final, chunks = follow(api, alices_session, started["id"])
    assert (final["state"], final["cancelled"], chunks) == ("cancelled", True, [("stdout", "started\n")])
    again = api.delete(exec_url(alices_session, started["id"]))  # idempotent
    assert (again.status_code, again.json()["state"]) == (200, "cancelled")


def test_an_exec_cancelled_before_an_agent_took_it_never_runs(alices_session, alice):
    api = client_for(alice)
    started = stream(api, alices_session, "touch ran")  # no agent answers yet

    body = api.delete(exec_url(alices_session, started["id"])).json()

    assert (body["state"], body["cancelled"], body["exit_code"], body["running"]) == ("cancelled", True, None, False)
    # An agent that takes it now finds it cancelled and does not start it (compare-and-set).
    assert not exec_store_default().transition(record_id(alices_session.node.name, started["id"]), from_states=("starting",), fields={"state": "running"})


def test_an_ended_exec_is_left_as_it_is_by_delete(alices_session, alice, demo_agent):
    demo_agent(alices_session)
    api = client_for(alice)
    started = stream(api, alices_session, "echo done")
    follow(api, alices_session, started["id"])

    response = api.delete(exec_url(alices_session, started["id"]))

    assert response.status_code == 200
    assert (response.json()["state"], response.json()["cancelled"], response.json()["exit_code"]) == (
        "exited", False, 0)


def test_an_exec_no_agent_takes_fails_after_the_grace_and_cannot_start_later(alices_session, alice, monkeypatch):
    monkeypatch.setattr(services, "EXEC_REPLY_GRACE_S", 0.2)
    api = client_for(alice)
    started = stream(api, alices_session, ["true"])

    failed = wait_until(lambda: (body := read(api, alices_session, started["id"]))["state"] == "failed" and body,
                        timeout=10, interval=0.05, what="the exec to be given up")

    assert failed["running"] is False and failed["complete"] is True
    assert "demo-node did not take the command" in failed["error"]
    assert not exec_store_default().transition(record_id(alices_session.node.name, started["id"]), from_states=("starting",), fields={"state": "running"})


def test_a_streamed_exec_still_running_when_its_session_stops_is_killed_with_it(tmp_path):
    store = exec_store_default()
    exec_id = str(uuid.uuid4())

    async def scenario(h):
        session_id = await h.start_session(start_spec())
        store.create(record_id(h.agent.node, exec_id), {"session": session_id, "node": h.agent.node, "command": '"sleep 60"', "timeout": "120",
                               "cap": "1000", "state": "starting", "cancel": "0", "created_ms": "0"}, ttl_s=60)
        await h.to_pty(session_id, {"type": "pty.exec_stream", "exec_id": exec_id, "argv": "sleep 60",
                                    "timeout": 120, "ttl": 60})
        await wait_until_async(lambda: h.agent.sessions[session_id].execs, timeout=20, interval=0.02,
                               what="the command running")
        await asyncio.to_thread(h.agent.submit_stop, session_id)
        await h.manager.wait_for_report(session_id, "TERMINATED")
        await wait_until_async(lambda: store.get(record_id(h.agent.node, exec_id))["state"] != "running", timeout=20,
                               interval=0.02, what="the exec no longer running")
        return store.get(record_id(h.agent.node, exec_id))

    record = run_agent(tmp_path, scenario)

    assert (record["state"], record["exit_code"]) == ("exited", str(128 + 9))
    assert record["error"] == "killed: the session is ending (terminated)"


def test_a_missing_program_exits_127_with_the_reason_on_stderr(alices_session, alice, demo_agent):
    demo_agent(alices_session)
    api = client_for(alice)

    final, chunks = follow(api, alices_session, stream(api, alices_session, ["no-such-program-here"])["id"])

    assert (final["state"], final["exit_code"]) == ("exited", 127)
    assert "no-such-program-here" in text_of(chunks, "stderr")


# --- who may ------------------------------------------------------------------------------------

def test_the_owner_and_an_administrator_read_and_an_administrator_cancels(alices_session, alice, staff):
    started = stream(client_for(alice), alices_session, "sleep 5")  # no agent: it stays `starting`

    for user in (alice, staff):
        assert read(client_for(user), alices_session, started["id"])["id"] == started["id"]
    by_admin = client_for(staff).delete(exec_url(alices_session, started["id"]))

    assert (by_admin.status_code, by_admin.json()["state"]) == (200, "cancelled")
    assert stream(client_for(staff), alices_session, "true")["session"] == str(alices_session.pk)


def test_another_user_gets_a_404_and_the_anonymous_a_401_and_neither_can_cancel(alices_session, alice, bob):
    started = stream(client_for(alice), alices_session, "sleep 5")

    for user, status in ((bob, 404), (None, 401)):
        client = client_for(user)
        assert_error_shape(client.post(exec_url(alices_session), {"command": "true", "stream": True}, format="json"),
                           status)
        assert_error_shape(client.get(exec_url(alices_session, started["id"])), status)
        assert_error_shape(client.delete(exec_url(alices_session, started["id"])), status)

    assert read(client_for(alice), alices_session, started["id"])["state"] == "starting"  # not cancelled


def test_an_exec_is_found_only_under_its_own_session(alices_session, alice, demo_cluster):
    api = client_for(alice)
    started = stream(api, alices_session, "true")
    other = admission.session_create(owner=alice, name="other", resources={"cuda.shares": "0.5"})

    for method in ("get", "delete"):
        assert_error_shape(getattr(api, method)(exec_url(other, started["id"])), 404)
        assert_error_shape(getattr(api, method)(exec_url(alices_session, uuid.uuid4())), 404)


def test_a_streamed_exec_needs_a_running_session_and_a_valid_cursor(alices_session, alice):
    api = client_for(alice)
    started = stream(api, alices_session, "true")
    for since in ("-1", "x", ""):
        body = assert_error_shape(api.get(exec_url(alices_session, started["id"]) + f"?since={since}"), 400)
        assert list(body["field_errors"]) == ["since"]
    end(alices_session)

    refused = api.post(exec_url(alices_session), {"command": "true", "stream": True}, format="json")

    assert assert_error_shape(refused, 409)["type"] == "session-not-running"
    assert read(api, alices_session, started["id"])["id"] == started["id"]  # still readable after the session ended


# --- the stores ---------------------------------------------------------------------------------

@pytest.fixture(params=["redis", "memory"])
def store(request):
    return RedisExecStore(settings.REDIS_URL) if request.param == "redis" else MemoryExecStore()


def new_exec(store, cap: int = 5) -> str:
    exec_id = str(uuid.uuid4())
    store.create(exec_id, {"session": "s", "state": "starting", "cap": str(cap)}, ttl_s=60)
    return exec_id


def test_a_store_cuts_each_stream_at_its_cap_on_a_character_boundary_and_says_which_are_full(store):
    exec_id = new_exec(store)

    first = store.append(exec_id, [("o", "abc"), ("e", "é")])
    second = store.append(exec_id, [("o", "dé"), ("e", "xyz")])
    third = store.append(exec_id, [("e", "!")])  # stderr is exactly full: now nothing more fits
    record, chunks, total = store.read(exec_id, since=0, max_chunks=10)

    assert (first, second, third) == (set(), {"o"}, {"e"})
    assert chunks == [("o", "abc"), ("e", "é"), ("o", "d"), ("e", "xyz")] and total == 4
    assert (record["truncated"], record["bytes_o"], record["bytes_e"]) == ("1", "4", "5")


def test_a_store_transition_is_a_compare_and_set_on_the_state(store):
    exec_id = new_exec(store)

    assert store.transition(exec_id, from_states=("starting",), fields={"state": "running"})
    assert not store.transition(exec_id, from_states=("starting",), fields={"state": "cancelled"})
    assert store.transition(exec_id, from_states=("starting", "running"), fields={"state": "exited", "exit_code": "0"},
                            ttl_s=30)
    assert store.get(exec_id)["state"] == "exited"
    assert not store.transition(str(uuid.uuid4()), from_states=("starting",), fields={"state": "running"})
    assert store.append(str(uuid.uuid4()), [("o", "x")]) is None
    assert store.read(str(uuid.uuid4()), since=0, max_chunks=5) == (None, [], 0)


def test_a_store_reads_from_an_offset_at_most_so_many_chunks(store):
    exec_id = new_exec(store, cap=100)
    store.append(exec_id, [("o", "a"), ("e", "b"), ("o", "c")])

    assert store.read(exec_id, since=1, max_chunks=1)[1:] == ([("e", "b")], 3)
    assert store.read(exec_id, since=3, max_chunks=5)[1:] == ([], 3)


def test_a_stream_flag_that_is_not_a_boolean_is_a_400_naming_it(alices_session, alice):
    response = client_for(alice).post(exec_url(alices_session), {"command": "true", "stream": "maybe"}, format="json")

    assert list(assert_error_shape(response, 400)["field_errors"]) == ["stream"]
