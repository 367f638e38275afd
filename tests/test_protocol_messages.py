"""The typed messages between the manager and its agents (protocol.messages): each encoder and
decoder round-trips, writes the wire the untyped dicts wrote (so agents and managers of adjacent
versions interoperate), takes an earlier version's shape, and refuses a malformed message with a
clear error, which the receiving side logs and drops."""

from __future__ import annotations

import json
import logging
import re
import uuid

import pytest

import protocol
from agent import tasks as agent_tasks
from agent.manager_link import CeleryManager
from protocol.messages import (
    AgentState,
    Heartbeat,
    LogBatch,
    Malformed,
    MigBlock,
    MigPlacement,
    Registration,
    SessionEnd,
    SessionNotice,
    SessionReport,
    SessionState,
    SessionsSync,
    SessionStop,
    StartDevice,
    StartSpec,
    UsageBatch,
)
from sessions import tasks as manager_tasks
from sessions.models import SessionLogChunk, SessionStatus

SESSION = str(uuid.UUID(int=0x5E55_1000))  # fixed: a parametrized test's id may hold it (pytest-xdist)

DEVICE = {
    "device_id": "GPU-8d1f0c2e",
    "index": 0,
    "model_name": "NVIDIA A100-SXM4-80GB",
    "memory_total": 80 << 30,
    "subproc_count": 108,
    "memory_limit": 20 << 30,
    "procs": "27",
    "shares": "0.25",
    "is_mig_device": False,
    "mig_profile": "",
}
MIG = {
    "gpu": "GPU-8d1f0c2e",
    "index": 0,
    "model_name": "NVIDIA A100-SXM4-80GB",
    "memory_size": 80 << 30,
    "subproc_count": 108,
    "profile": "3g.40gb",
    "start": 4,
    "reuse": False,
    "instance_id": str(uuid.uuid4()),
    "destroy": [{"profile": "1g.10gb", "start": 4}],
    "layout": [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}],
}
SPEC = {  # as sessions.lifecycle.start_spec.session_start_spec wrote it before it was typed
    "session_id": SESSION,
    "image": "fgpu-session:test",
    "shell": "/bin/bash",
    "name": "notebook",
    "owner": "alice",
    "owner_id": 7,
    "owner_is_staff": False,
    "projects": [{"id": "3", "name": "lab"}],
    "command": "",
    "cpu": 2,
    "mem": 4 << 30,
    "slot_name": "cuda",
    "slot_subtype": "shares",
    "devices": [DEVICE],
    "mig": MIG,
}


# --- start spec ----------------------------------------------------------------------------------


def test_a_start_spec_decodes_to_typed_fields_and_encodes_to_the_same_json():
    spec = StartSpec.decode(SPEC)
    assert spec.devices[0].hardware_id == "GPU-8d1f0c2e"  # the plugin's id, named so
    assert spec.mig is not None and spec.mig.destroy == (MigPlacement("1g.10gb", 4),)
    assert spec.version == 1
    assert spec.encode() == SPEC  # the wire is unchanged: no version key at version 1
    assert StartSpec.decode(spec.encode()) == spec


def test_a_start_spec_from_a_manager_before_images_projects_and_owner_ids_is_accepted_with_defaults():
    old = {k: v for k, v in SPEC.items() if k not in ("image", "shell", "projects", "owner_id", "owner_is_staff", "mig")}
    spec = StartSpec.decode(old)
    assert (spec.image, spec.shell, spec.projects, spec.owner_id, spec.owner_is_staff, spec.mig) == (
        "",
        "",
        (),
        None,
        False,
        None,
    )
    assert spec.encode() == {**old, "image": "", "shell": "", "projects": [], "owner_id": None, "owner_is_staff": False}


def test_a_later_version_s_start_spec_is_read_for_the_fields_this_side_knows():
    spec = StartSpec.decode({**SPEC, "version": 2, "gpu_clock_mhz": 1410})
    assert spec.version == 2 and spec.name == "notebook"
    assert spec.encode()["version"] == 2


@pytest.mark.parametrize(
    "change, says",
    [
        ({"session_id": None}, "without 'session_id'"),
        ({"cpu": "2"}, "'cpu' of a start spec is not a whole number"),
        ({"mem": -1}, "'mem' of a start spec is negative"),
        ({"owner_is_staff": "yes"}, "'owner_is_staff' of a start spec is not bool"),
        ({"devices": {"0": DEVICE}}, "'devices' of a start spec is not list"),
        ({"devices": [{**DEVICE, "procs": "lots"}]}, "'procs' of a start spec's device is not a decimal amount"),
        ({"devices": [{**DEVICE, "shares": "NaN"}]}, "'shares' of a start spec's device is not a decimal amount"),
        ({"devices": [{k: v for k, v in DEVICE.items() if k != "device_id"}]}, "without 'device_id'"),
        ({"devices": ["GPU-0"]}, "a start spec's device that is not an object"),
        ({"mig": {**MIG, "gpu": 0}}, "'gpu' of a MIG block is not str"),
        ({"mig": {**MIG, "destroy": [{"profile": "1g.10gb"}]}}, "a MIG placement without 'start'"),
        ({"version": 0}, "a start spec of version 0"),
    ],
)
def test_a_malformed_start_spec_is_refused_saying_which_field(change, says):
    with pytest.raises(Malformed, match=says.replace("(", r"\(").replace(")", r"\)")):
        StartSpec.decode({**SPEC, **change})


def test_a_start_spec_that_is_not_an_object_is_refused():
    with pytest.raises(Malformed, match="a start spec that is not an object"):
        StartSpec.decode(["not", "a", "spec"])


def test_the_agent_drops_a_malformed_start_with_a_log_line_and_does_not_start_it(caplog):
    # agent.tasks decodes before it looks the node's agent up: none exists here, so a start that
    # got through would raise
    with caplog.at_level(logging.WARNING, logger="agent.tasks"):
        agent_tasks.session_start(node="no-agent-here", spec={**SPEC, "devices": "all"})
    assert "dropped a malformed start: 'devices' of a start spec is not list" in caplog.text


def test_the_mig_block_and_device_entry_encode_their_fields_under_the_wire_names():
    block = MigBlock.decode(MIG)
    assert block.encode() == MIG
    device = StartDevice.decode(DEVICE)
    assert device.encode() == DEVICE and device.hardware_id == DEVICE["device_id"]


# --- heartbeat, report, log batch --------------------------------------------------------------------

BEAT = {
    "node": "gpu-1",
    "running": [SESSION],
    "mig_digest": "ab12",
    "state": {"sessions": {}, "ended": {}, "at": 1.5},
    "images": {"host": "host"},
    "image_service_ports": {"sha256:1": "jupyter:http:8888"},
}
REPORT = {"session_id": SESSION, "status": "RUNNING", "reason": "", "exit_code": None, "node": "gpu-1"}
BATCH = {"session_id": SESSION, "seq": 3, "offset": 120, "text": "hello\n", "final": False, "node": "gpu-1"}


@pytest.mark.parametrize(
    "kind, wire",
    [(Heartbeat, BEAT), (SessionReport, REPORT), (LogBatch, BATCH)],
)
def test_agent_messages_round_trip_to_the_same_keyword_arguments(kind, wire):
    message = kind.decode(wire)
    assert message.encode() == wire
    assert kind.decode(message.encode()) == message


@pytest.mark.parametrize(
    "kind, old",
    [
        (Heartbeat, {"node": "gpu-1", "running": [], "mig_digest": None, "state": None}),  # before images
        (Heartbeat, {"node": "gpu-1", "running": []}),  # before MIG and state
        (SessionReport, {"session_id": SESSION, "status": "TERMINATED", "reason": "done", "exit_code": 0}),  # before node keys
        (LogBatch, {"session_id": SESSION, "seq": 0, "offset": 0, "text": "x"}),  # before `final` and node keys
    ],
)
def test_agent_messages_of_an_earlier_version_are_accepted(kind, old):
    message = kind.decode(old)
    assert message.version == 1
    assert {k: v for k, v in message.encode().items() if v is not None} == {k: v for k, v in old.items() if v is not None} | (
        {"final": False} if kind is LogBatch else {}
    ) | ({"reason": ""} if kind is SessionReport and "reason" not in old else {})


def test_a_heartbeat_sends_no_images_when_it_has_none_and_no_service_ports_when_there_are_none():
    wire = Heartbeat.decode({**BEAT, "images": None, "image_service_ports": {}}).encode()
    assert "images" not in wire and "image_service_ports" not in wire


# --- the heartbeat's state -----------------------------------------------------------------------------

# fixed, not random: they are in parametrized tests' ids, which every pytest-xdist worker must collect alike
RUNNING, STARTING, STOPPING, DONE, FAILED = (str(uuid.UUID(int=0x5E55_0000 + n)) for n in range(5))
STATE = {  # as agent.core.Agent.state wrote it before it was typed
    "sessions": {RUNNING: "RUNNING", STARTING: "PREPARING", STOPPING: "TERMINATING"},
    "ended": {
        DONE: {"status": "TERMINATED", "reason": "the process exited with code 3", "exit_code": 3},
        FAILED: {"status": "ERROR", "reason": "the image could not be pulled", "exit_code": None},
    },
    "at": 1_790_000_000.25,
}


def test_a_heartbeat_s_state_decodes_to_typed_entries_and_encodes_to_the_same_json():
    wire = {**BEAT, "running": [RUNNING, STARTING, STOPPING], "state": STATE}
    beat = Heartbeat.decode(wire)
    assert beat.state is not None and beat.state_error == ""
    assert beat.state.sessions == (
        SessionState(RUNNING, "RUNNING"), SessionState(STARTING, "PREPARING"), SessionState(STOPPING, "TERMINATING")
    )
    assert beat.state.ended == (
        SessionEnd(DONE, "TERMINATED", "the process exited with code 3", 3), SessionEnd(FAILED, "ERROR", "the image could not be pulled")
    )
    assert beat.state.at == STATE["at"] and beat.state.statuses[STOPPING] == "TERMINATING" and beat.state.ends[DONE].exit_code == 3
    assert (beat.state.malformed, beat.state.unreadable) == ((), frozenset())
    assert json.dumps(beat.encode()) == json.dumps(wire)  # byte for byte, the keys in their order
    assert Heartbeat.decode(beat.encode()) == beat


def test_the_agent_sends_its_typed_state_as_the_json_of_the_untyped_dict():
    manager = Recording("gpu-1")
    state = AgentState(
        at=STATE["at"],
        sessions=(SessionState(RUNNING, "RUNNING"), SessionState(STARTING, "PREPARING"), SessionState(STOPPING, "TERMINATING")),
        ended=(SessionEnd(DONE, "TERMINATED", "the process exited with code 3", 3), SessionEnd(FAILED, "ERROR", "the image could not be pulled")),
    )
    manager.heartbeat("gpu-1", [RUNNING, STARTING, STOPPING], None, state, None)
    (task, sent), = manager.sent
    assert task == protocol.AGENT_HEARTBEAT
    assert json.dumps(sent["state"]) == json.dumps(STATE)


@pytest.mark.parametrize(
    "old",
    [
        {"sessions": {RUNNING: "RUNNING"}, "at": 1_790_000_000.25},  # before ends were kept
        {"sessions": None, "ended": None, "at": 0},
        {"at": 1_790_000_000},
    ],
)
def test_an_earlier_agent_s_state_is_read_with_what_it_lacks_as_none(old):
    state = Heartbeat.decode({**BEAT, "state": old}).state
    assert state is not None and state.at == old["at"] and state.ended == () and not state.malformed
    assert state.statuses == (old.get("sessions") or {})
    assert state.encode() == {"sessions": old.get("sessions") or {}, "ended": {}, "at": old["at"]}


def test_a_later_version_s_heartbeat_is_read_for_the_fields_of_its_state_this_side_knows():
    later = {
        **BEAT,
        "version": 2,
        "cpu_load": 0.5,
        "state": {
            "sessions": {RUNNING: "RUNNING"},
            "ended": {DONE: {**STATE["ended"][DONE], "signal": 9}},
            "at": 1_790_000_000.25,
            "pids": {RUNNING: [4242]},
        },
    }
    beat = Heartbeat.decode(later)
    assert beat.version == 2 and beat.state is not None and not beat.state.malformed
    assert beat.state.statuses == {RUNNING: "RUNNING"} and beat.state.ends == {DONE: SessionEnd(DONE, "TERMINATED", "the process exited with code 3", 3)}
    assert beat.encode()["state"] == {"sessions": {RUNNING: "RUNNING"}, "ended": {DONE: STATE["ended"][DONE]}, "at": 1_790_000_000.25}
    assert beat.encode()["version"] == 2


@pytest.mark.parametrize(
    "entries, says",
    [
        ({"sessions": {RUNNING: "PAUSED"}}, f"'status' of session '{RUNNING}' in a heartbeat's state is 'PAUSED', not one of PREPARING, RUNNING, TERMINATING"),
        ({"sessions": {RUNNING: None}}, "is 'NoneType', not one of"),
        ({"ended": {RUNNING: "TERMINATED"}}, f"a heartbeat's end of session '{RUNNING}' that is not an object"),
        ({"ended": {RUNNING: {"reason": "gone"}}}, f"a heartbeat's end of session '{RUNNING}' without 'status'"),
        ({"ended": {RUNNING: {"status": "done"}}}, f"'status' of a heartbeat's end of session '{RUNNING}' is 'done', not a session state"),
        ({"ended": {RUNNING: {"status": "ERROR", "exit_code": "1"}}}, "'exit_code' of a heartbeat's end of session .* is not a whole number"),
        ({"ended": {RUNNING: {"status": "ERROR", "exit_code": True}}}, "'exit_code' of a heartbeat's end of session .* is not a whole number"),
        ({"ended": {RUNNING: {"status": "ERROR", "reason": ["x"]}}}, "'reason' of a heartbeat's end of session .* is not str"),
    ],
)
def test_a_malformed_entry_of_a_state_is_left_out_naming_its_session_and_field_and_the_rest_is_read(entries, says):
    wire = {"sessions": {STARTING: "PREPARING", **entries.get("sessions", {})}, "ended": {DONE: STATE["ended"][DONE], **entries.get("ended", {})}, "at": 5}
    state = AgentState.decode(wire)
    assert len(state.malformed) == 1 and re.search(says, state.malformed[0]), state.malformed
    assert state.unreadable == {RUNNING}
    assert state.statuses == {STARTING: "PREPARING"} and set(state.ends) == {DONE}  # the rest is read
    assert RUNNING not in json.dumps(state.encode())  # what could not be read is not sent on


def test_an_end_read_by_the_quick_path_or_the_field_by_field_one_is_the_same():
    ends = {DONE: {"status": "TERMINATED", "reason": None, "exit_code": None}, FAILED: {"status": "ERROR"}}
    state = AgentState.decode({"ended": ends, "at": 5})  # a null or missing reason reads as "", as the field readers say
    assert state.ended == (SessionEnd(DONE, "TERMINATED"), SessionEnd(FAILED, "ERROR")) and not state.malformed
    for end in STATE["ended"].items():
        assert SessionEnd.decode(*end) == SessionEnd.read(*end)


def test_an_entry_not_keyed_by_text_is_counted_malformed_and_names_no_session():
    state = AgentState.decode({"sessions": {7: "RUNNING", STARTING: "PREPARING"}, "at": 5})
    assert state.malformed == ("a heartbeat's session state keyed by int, not a session id",)
    assert state.unreadable == frozenset() and state.statuses == {STARTING: "PREPARING"}


@pytest.mark.parametrize(
    "state, says",
    [
        ([], "a heartbeat's state that is not an object"),
        ({"sessions": {}}, "a heartbeat's state without 'at'"),
        ({"at": None}, "a heartbeat's state without 'at'"),
        ({"at": "1.5"}, "'at' of a heartbeat's state is not a time in epoch seconds"),
        ({"at": True}, "'at' of a heartbeat's state is not a time in epoch seconds"),
        ({"at": -1}, "'at' of a heartbeat's state is not a time in epoch seconds"),
        ({"at": float("nan")}, "'at' of a heartbeat's state is not a time in epoch seconds"),
        ({"at": 1e300}, "'at' of a heartbeat's state is not a time in epoch seconds"),
        ({"at": 5, "sessions": [RUNNING]}, "'sessions' of a heartbeat's state is not dict"),
        ({"at": 5, "ended": [DONE]}, "'ended' of a heartbeat's state is not dict"),
    ],
)
def test_a_state_that_cannot_be_read_at_all_is_refused_but_the_rest_of_its_heartbeat_is_read(state, says):
    with pytest.raises(Malformed, match=says):
        AgentState.decode(state)
    beat = Heartbeat.decode({**BEAT, "state": state})
    assert beat.state is None and says in beat.state_error
    assert (beat.node, beat.running, beat.images) == ("gpu-1", (SESSION,), {"host": "host"})


@pytest.mark.parametrize(
    "kind, wire, says",
    [
        (Heartbeat, {**BEAT, "running": SESSION}, "'running' of a heartbeat is not list"),
        (Heartbeat, {**BEAT, "running": [1]}, "'running' of a heartbeat is not a list of strings"),
        (Heartbeat, {k: v for k, v in BEAT.items() if k != "node"}, "a heartbeat without 'node'"),
        (SessionReport, {**REPORT, "status": "running"}, "a session report of status 'running'"),
        (SessionReport, {**REPORT, "exit_code": "1"}, "'exit_code' of a session report is not a whole number"),
        (LogBatch, {**BATCH, "seq": -1}, "'seq' of a log batch is negative"),
        (LogBatch, {**BATCH, "offset": True}, "'offset' of a log batch is not a whole number"),
        (LogBatch, {**BATCH, "text": b"x"}, "'text' of a log batch is not str"),
    ],
)
def test_a_malformed_agent_message_is_refused_saying_which_field(kind, wire, says):
    with pytest.raises(Malformed, match=says):
        kind.decode(wire)


class Recording(CeleryManager):
    def __init__(self, node: str) -> None:
        super().__init__(app=None, node=node)
        self.sent: list[tuple[str, dict]] = []

    def _send(self, task: str, **options) -> None:
        self.sent.append((task, options["kwargs"]))


def test_the_agent_sends_the_keyword_arguments_an_earlier_manager_takes():
    manager = Recording("gpu-1")
    manager.heartbeat(
        "gpu-1", [SESSION], "ab12", AgentState(at=1.5), {"host": "host"}, image_service_ports=BEAT["image_service_ports"]
    )
    manager.report(SESSION, "RUNNING", "", None)
    manager.log(SESSION, 3, 120, "hello\n", False)
    assert manager.sent == [
        (protocol.AGENT_HEARTBEAT, BEAT),
        (protocol.SESSION_REPORT, REPORT),
        (protocol.SESSION_LOG_APPEND, BATCH),
    ]
    unnamed = Recording("")
    unnamed.report(SESSION, "RUNNING", "", None)
    assert unnamed.sent[0][1]["node"] is None  # standalone: no node named, as before


@pytest.mark.django_db
def test_the_manager_logs_and_drops_malformed_agent_messages(alices_session, caplog):
    sid = str(alices_session.pk)
    with caplog.at_level(logging.WARNING):  # accelerators.node_messages says why
        manager_tasks.agent_heartbeat(node=alices_session.node.name, running="all")
        manager_tasks.session_report(session_id=sid, status=["TERMINATED"], reason="", exit_code=0)
        manager_tasks.session_log_append(session_id=sid, seq="0", offset=0, text="x")
    assert caplog.text.count("dropped an agent's malformed message") == 3
    alices_session.refresh_from_db()
    assert alices_session.status == SessionStatus.RUNNING
    assert not SessionLogChunk.objects.filter(session=alices_session).exists()
    manager_tasks.session_log_append(session_id=sid, seq=0, offset=0, text="x")  # a good one is applied
    assert SessionLogChunk.objects.filter(session=alices_session).count() == 1


@pytest.mark.django_db
def test_the_scheduler_s_start_spec_decodes_and_encodes_to_itself(alices_session):
    from sessions.models import Allocation
    from sessions.lifecycle.reconcile import session_start_spec_again
    from sessions.lifecycle.start_spec import session_start_spec

    allocations = list(Allocation.objects.filter(session=alices_session).select_related("device"))
    wire = session_start_spec(alices_session, allocations)
    spec = StartSpec.decode(wire)
    assert spec.encode() == wire and "version" not in wire
    assert spec.devices[0].hardware_id == allocations[0].device.device_id != str(allocations[0].device.pk)
    assert session_start_spec_again(alices_session) == wire  # the reconcile's re-sent start: the same builder


# --- manager → agent: a stop, the sessions to keep, a notice ------------------------------------------

STOP = {"node": "gpu-1", "session_id": SESSION}
SYNC = {"node": "gpu-1", "keep": [SESSION]}
NOTICE = {"node": "gpu-1", "session_id": SESSION, "text": "idle for 50 minutes: ends in 10"}


@pytest.mark.parametrize("kind, wire", [(SessionStop, STOP), (SessionsSync, SYNC), (SessionNotice, NOTICE)])
def test_the_manager_s_session_messages_round_trip_to_the_same_keyword_arguments(kind, wire):
    message = kind.decode(wire)
    assert message.encode() == wire and message.version == 1
    assert kind.decode({**wire, "version": 2, "later": True}).encode() == {**wire, "version": 2}


@pytest.mark.parametrize(
    "kind, wire, says",
    [
        (SessionStop, {"node": "gpu-1"}, "a session stop without 'session_id'"),
        (SessionStop, {**STOP, "session_id": 7}, "'session_id' of a session stop is not str"),
        (SessionsSync, {**SYNC, "keep": SESSION}, "'keep' of a sessions sync is not list"),
        (SessionsSync, {**SYNC, "keep": [None]}, "'keep' of a sessions sync is not a list of strings"),
        (SessionNotice, {**NOTICE, "text": ["idle"]}, "'text' of a session notice is not str"),
        (SessionNotice, {**NOTICE, "version": -1}, "a session notice of version -1"),
    ],
)
def test_a_malformed_session_message_to_the_agent_is_refused_saying_which_field(kind, wire, says):
    with pytest.raises(Malformed, match=says):
        kind.decode(wire)


def test_the_agent_drops_malformed_session_messages_with_a_log_line_and_acts_on_none(caplog):
    # each task decodes before it looks the node's agent up: none exists here, so one that got
    # through would raise LookupError
    with caplog.at_level(logging.WARNING, logger="agent.tasks"):
        agent_tasks.session_stop(node="no-agent-here", session_id=None)
        agent_tasks.sessions_sync(node="no-agent-here", keep="all")
        agent_tasks.session_notice(node="no-agent-here", session_id=SESSION)
    assert "dropped a malformed SessionStop: a session stop without 'session_id'" in caplog.text
    assert "dropped a malformed SessionsSync: 'keep' of a sessions sync is not list" in caplog.text
    assert "dropped a malformed SessionNotice: a session notice without 'text'" in caplog.text
    with pytest.raises(LookupError):
        agent_tasks.session_stop(**STOP)  # a good one reaches the lookup


# --- the registration ----------------------------------------------------------------------------------

INVENTORY = {  # as agent.boot.load_inventory builds it
    "devices": [{"device_id": "GPU-8d1f0c2e", "index": 0, "slot_name": "cuda"}],
    "links": [{"a": "GPU-8d1f0c2e", "b": "GPU-9", "kind": "nvlink", "count": 12}],
    "plugins": ["ai.backend.accelerator.cuda_open"],
    "attributes": {"mps": False},
    "cpu_count": 8,
    "memory_size": 32 << 30,
    "warnings": [],
    "storage": {"shared": False},
}
REGISTRATION = {"node": "gpu-1", "inventory": INVENTORY, "running": [SESSION], "images": {"host": "host"}}


def test_a_registration_round_trips_to_the_same_keyword_arguments_and_an_older_agent_s_too():
    registration = Registration.decode(REGISTRATION)
    assert registration.inventory.cpu_count == 8 and registration.running == (SESSION,)
    assert registration.encode() == REGISTRATION
    old = {"node": "gpu-1", "inventory": {"devices": [], "plugins": [], "attributes": {}}, "running": []}  # before images
    assert Registration.decode(old).encode() == old
    manager = Recording("gpu-1")
    manager.register("gpu-1", INVENTORY, [SESSION], {"host": "host"}, image_service_ports={})
    assert manager.sent == [(protocol.AGENT_REGISTER, REGISTRATION)]  # what the agent sends, as before


@pytest.mark.parametrize(
    "change, says",
    [
        ({"inventory": None}, "a registration without 'inventory'"),
        ({"inventory": {**INVENTORY, "devices": ["GPU-0"]}}, "'devices' of a node inventory is not a list of objects"),
        ({"inventory": {**INVENTORY, "cpu_count": "8"}}, "'cpu_count' of a node inventory is not a whole number"),
        ({"inventory": {**INVENTORY, "plugins": "cuda"}}, "'plugins' of a node inventory is not list"),
        ({"running": [1]}, "'running' of a registration is not a list of strings"),
    ],
)
def test_a_malformed_registration_is_refused_saying_which_field(change, says):
    with pytest.raises(Malformed, match=says):
        Registration.decode({**REGISTRATION, **change})


@pytest.mark.django_db
def test_the_manager_logs_and_drops_a_malformed_registration_and_applies_a_good_one(caplog):
    from accelerators.models import Node
    from tests.test_agent_runtime import DEVICE

    inventory = {"devices": [DEVICE.as_dict()], "plugins": [], "attributes": {}}
    with caplog.at_level(logging.WARNING):  # accelerators.node_messages and sessions.tasks say why
        manager_tasks.agent_register(node="reg-1", inventory={**inventory, "memory_size": -1}, running=[])
        manager_tasks.agent_register(node="reg-1", inventory={"devices": [{"device_id": "GPU-0", "colour": "red"}]}, running=[])
    assert "dropped an agent's malformed message: 'memory_size' of a node inventory is negative" in caplog.text
    assert "dropped the registration of node reg-1: a device the manager cannot read" in caplog.text
    assert not Node.objects.filter(name="reg-1").exists()
    manager_tasks.agent_register(node="reg-1", inventory=inventory, running=[])
    assert Node.objects.get(name="reg-1").devices.count() == 1


# --- the usage batch ----------------------------------------------------------------------------------

SESSION_SAMPLE = {  # as agent.usage.UsageSampler.sample writes one
    "session_id": SESSION,
    "t": 1_790_000_000,
    "span": 5,
    "gpu_memory": 1 << 30,
    "gpu_util": 40,
    "cpu": 250,
    "mem": 100 << 20,
    "last_input": None,
    "storage": 4096,
    "storage_limit": 10 << 30,
    "folders": [{"folder": "~/data", "used": 0, "limit": 1 << 30}, {"folder": "~/projects/alpha", "used": 5, "limit": 9}],
}
DEVICE_SAMPLE = {"device": "GPU-8d1f0c2e", "t": 1_790_000_000, "memory_used": 1 << 30, "memory_total": 80 << 30, "util": None}
USAGE = {"node": "gpu-1", "batch": {"interval": 5.0, "devices": [DEVICE_SAMPLE], "sessions": [SESSION_SAMPLE]}}


def test_a_usage_batch_round_trips_to_the_same_keyword_arguments_and_the_agent_sends_them():
    batch = UsageBatch.decode(USAGE)
    assert batch.node == "gpu-1" and batch.malformed == 0
    assert batch.sessions[0].folders[1].folder == "~/projects/alpha" and batch.devices[0].util is None
    assert batch.encode() == USAGE
    manager = Recording("gpu-1")
    manager.usage(batch)
    assert manager.sent == [(protocol.USAGE_REPORT, USAGE)]  # the wire of the untyped dict, no version at 1


def test_a_usage_batch_of_an_earlier_agent_and_the_known_fields_of_a_later_one_are_read():
    old = {"session_id": SESSION, "t": 1_790_000_000, "gpu_memory": None, "gpu_util": None, "cpu": None, "mem": 1}
    earlier = UsageBatch.decode({"node": "gpu-1", "batch": {"devices": [], "sessions": [old]}})  # no span, storage, folders
    assert earlier.sessions[0].span == 1 and earlier.sessions[0].storage is None and earlier.sessions[0].folders == ()
    assert earlier.interval is None and earlier.malformed == 0
    later_sample = {**SESSION_SAMPLE, "power": 120}
    later = UsageBatch.decode({**USAGE, "version": 2, "region": "eu", "batch": {**USAGE["batch"], "sessions": [later_sample]}})
    assert later.version == 2 and later.sessions == UsageBatch.decode(USAGE).sessions
    assert later.encode() == {**USAGE, "version": 2}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"batch": []}, "a usage batch that is not an object"),
        ({"batch": {"sessions": "x", "devices": []}}, "'sessions' of a usage batch is not list"),
        ({"batch": {"sessions": []}}, "a usage batch without 'devices'"),
        ({"batch": {"devices": [{}] * 10_001, "sessions": [{}] * 10_000}}, "a usage batch of more than 20000 samples"),
        ({"batch": {**USAGE["batch"], "interval": "5"}}, "'interval' of a usage batch is not a positive number"),
        ({"node": None}, "a usage report without 'node'"),
        ({"version": 0}, "a usage report of version 0"),
    ],
)
def test_a_malformed_usage_batch_is_refused_saying_which_field(change, says):
    with pytest.raises(Malformed, match=says):
        UsageBatch.decode({**USAGE, **change})


@pytest.mark.parametrize(
    "session_change, device_change",
    [
        ({"gpu_util": 101}, {"util": 101}),
        ({"t": None}, {"t": None}),
        ({"span": None}, {"memory_used": -1}),
        ({"span": 0}, {"memory_total": "80G"}),
        ({"cpu": True}, {"device": None}),
        ({"session_id": 7}, {"t": 2**40 + 1}),
        ({"folders": [{"folder": "/etc", "used": 0, "limit": 0}]}, {"util": 1.5}),
        ({"folders": [{"folder": "~/data", "used": 0, "limit": 0}] * 65}, {"memory_used": None}),
        ({"folders": "~/data"}, {}),
    ],
)
def test_a_malformed_sample_is_left_out_and_counted_and_the_rest_of_its_batch_kept(session_change, device_change):
    sessions = [SESSION_SAMPLE, {**SESSION_SAMPLE, **session_change}]
    devices = [DEVICE_SAMPLE, {**DEVICE_SAMPLE, **device_change}] if device_change else [DEVICE_SAMPLE]
    batch = UsageBatch.decode({"node": "gpu-1", "batch": {"interval": 5, "devices": devices, "sessions": sessions}})
    assert batch.malformed == (2 if device_change else 1)
    assert batch.sessions == UsageBatch.decode(USAGE).sessions and batch.devices == UsageBatch.decode(USAGE).devices


@pytest.mark.django_db
def test_the_manager_logs_and_drops_a_malformed_usage_batch_and_stores_a_good_one(caplog):
    from usage.tasks import usage_report

    with caplog.at_level(logging.WARNING, logger="accelerators.node_messages"):
        dropped = usage_report(node="gpu-1", batch={"sessions": "x", "devices": []})
    assert dropped == {"stored": 0, "duplicates": 0, "refused": {"malformed batch": 1}}
    assert "dropped an agent's malformed message: 'sessions' of a usage batch is not list" in caplog.text
    bad_sample = {**SESSION_SAMPLE, "gpu_util": 101}
    read = usage_report(node="gpu-1", batch={**USAGE["batch"], "sessions": [SESSION_SAMPLE, bad_sample]})
    assert read["refused"] == {"malformed": 1, "unknown session": 1, "unknown device": 1}  # read, sample by sample
