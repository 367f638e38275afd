"""Agent messages authenticated by node keys (issue 13): with the broker's credentials alone,
nobody can mark another node's session ended, or write its log. The database is real; the
messages go through the manager's Celery tasks (eager), as the agent sends them."""
from __future__ import annotations

import io
import time
import logging

import pytest
from django.core.management import call_command

import protocol
from accelerators.models import Node, NodeStatus
from common.celery import app
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionLogChunk, SessionStatus
from agent.core import _AGENTS
from agent.manager_link import CeleryManager
from protocol.messages import AgentState
from tests.conftest import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db(transaction=True)


class Sink:
    def submit_start(self, spec):
        pass

    def submit_stop(self, session_id):
        pass

    def submit_sync(self, keep):
        pass

    def submit_mig_reconcile(self, *args, **kwargs):
        pass


@pytest.fixture
def cluster(alice):
    make_cluster(nodes={"node-a": [mock_gpu(0)], "node-b": [mock_gpu(1)]})
    for name in ("node-a", "node-b"):
        _AGENTS[name] = Sink()
    yield
    for name in ("node-a", "node-b"):
        _AGENTS.pop(name, None)


def running_on(node: str, owner) -> ComputeSession:
    session = admission.session_create(owner=owner, name="s", resources={"cuda.shares": "0.5"})
    session.refresh_from_db()
    ComputeSession.objects.filter(pk=session.pk).update(node=Node.objects.get(name=node))  # pin it for the test
    Allocation.objects.filter(session=session).update(device=Node.objects.get(name=node).devices.get())
    assert services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    session.refresh_from_db()
    return session


def key_for(node: str) -> str:
    out = io.StringIO()
    call_command("node_key", node, stdout=out)
    text = out.getvalue()
    assert text.startswith('[manager]\nnode-key = "')
    return text.split('"')[1]


def test_a_signed_report_from_the_sessions_own_node_applies(cluster, alice):
    session = running_on("node-a", alice)
    agent = CeleryManager(app, node="node-a", key=key_for("node-a"))
    agent.report(str(session.pk), "TERMINATED", "the process exited with code 0", 0)
    session.refresh_from_db()
    assert session.status == SessionStatus.TERMINATED


def test_a_forged_report_for_a_keyed_nodes_session_is_refused_and_logged(cluster, alice, caplog):
    session = running_on("node-a", alice)
    key_for("node-a")
    forgers = [CeleryManager(app),  # no key, no node: what anyone with the broker's password can send
               CeleryManager(app, node="node-a", key="guessed"),
               CeleryManager(app, node="node-b", key=key_for("node-b"))]  # a real key, of another node
    with caplog.at_level(logging.WARNING):
        for forger in forgers:
            forger.report(str(session.pk), "TERMINATED", "forged", 0)
            forger.log(str(session.pk), 0, 0, "forged output", True)
    session.refresh_from_db()
    assert session.status == SessionStatus.RUNNING
    assert Allocation.objects.filter(session=session, released_at__isnull=True).count() == 1
    assert not SessionLogChunk.objects.filter(session_id=session.pk).exists()  # no forged output stored
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(refusals) >= 6, refusals


def test_a_heartbeat_with_a_bad_signature_does_not_keep_a_node_alive(cluster):
    key_for("node-a")
    Node.objects.filter(name="node-a").update(status=NodeStatus.LOST)
    CeleryManager(app, node="node-a", key="guessed").heartbeat("node-a", [], None, AgentState(at=0))
    assert Node.objects.get(name="node-a").status == NodeStatus.LOST


def test_nodes_without_keys_are_refused_once_keys_are_required(cluster, alice, settings):
    session = running_on("node-b", alice)
    settings.FGPU_REQUIRE_NODE_KEYS = True
    CeleryManager(app, node="node-b").report(str(session.pk), "TERMINATED", "unsigned", 0)
    session.refresh_from_db()
    assert session.status == SessionStatus.RUNNING


def test_a_signature_covers_every_argument():
    kwargs = {"session_id": "s", "status": "RUNNING", "reason": "", "exit_code": None, "node": "n"}
    signature = protocol.sign("k", protocol.SESSION_REPORT, kwargs)
    assert protocol.verify("k", protocol.SESSION_REPORT, {**kwargs, "signature": signature}, signature)
    assert not protocol.verify("k", protocol.SESSION_REPORT, {**kwargs, "status": "TERMINATED"}, signature)
    assert not protocol.verify("k", protocol.SESSION_LOG_APPEND, kwargs, signature)
    assert not protocol.verify("other", protocol.SESSION_REPORT, kwargs, signature)


# --- commands to agents and their answers (protocol.channel) --------------------------------------


def test_a_sealed_command_opens_once_within_its_age_for_its_own_node_only():
    from protocol.channel import MAX_AGE_S, TO_AGENT, AgentLink, CommandGuard, Refused, seal

    guard, web = CommandGuard(node="node-a", key="k-a"), AgentLink(node="node-a", key="k-a")
    message = web.command({"type": "pty.input", "session_id": "s", "data": "ls\r"})

    assert guard.open(message) == {"type": "pty.input", "session_id": "s", "data": "ls\r"}
    for refused, why in (
        (message, "replayed"),
        ({"type": "pty.input", "session_id": "s", "data": "ls\r"}, "unsigned"),
        ({**message, "data": "rm -rf ~\r"}, "does not verify"),  # a changed field
        ({**message, "session_id": "t"}, "does not verify"),  # another session
        (AgentLink(node="node-b", key="k-a").command({"type": "pty.stop", "session_id": "s"}), "does not verify"),
        (AgentLink(node="node-a", key="k-b").command({"type": "pty.stop", "session_id": "s"}), "does not verify"),
        (seal({"type": "pty.stop", "session_id": "s"}, key="k-a", node="node-a", direction=TO_AGENT,
              now=time.time() - MAX_AGE_S - 5), "from now"),
        ({**message, "auth": {"ts": "1", "nonce": 2}}, "malformed"),
    ):
        with pytest.raises(Refused, match=why):
            guard.open(refused)


def test_a_node_without_a_key_takes_unsealed_commands_and_its_answers_pass_unless_keys_are_required():
    from protocol.channel import AgentLink, CommandGuard, Refused

    guard = CommandGuard(node="node-a", key="")
    assert guard.open({"type": "pty.stop", "session_id": "s"}) == {"type": "pty.stop", "session_id": "s"}
    assert guard.answer({"type": "exec.result"}) == {"type": "exec.result"}
    assert AgentLink(node="node-a").answer({"type": "exec.result"}) == {"type": "exec.result"}
    with pytest.raises(Refused, match="keys are required"):
        AgentLink(node="node-a", required=True).answer({"type": "exec.result"})


def test_commands_are_typed_and_malformed_ones_are_refused():
    from protocol.channel import Malformed, PtyAck, PtyExec, PtyResize, command_from_dict

    assert command_from_dict({"type": "pty.resize", "session_id": "s", "rows": 24, "cols": 80}) == PtyResize("s", 24, 80)
    ack = PtyAck("s", "specific.x!y", 10, 1)
    assert command_from_dict(ack.to_dict()) == ack
    assert command_from_dict({"type": "pty.exec", "session_id": "s", "argv": ["ls"], "timeout": 5,
                              "reply_channel": "r"}) == PtyExec("s", ["ls"], 5, "r")
    for bad in ({"type": "pty.resize", "session_id": "s", "rows": "24", "cols": 80},
                {"type": "pty.resize", "session_id": "s", "rows": 0, "cols": 80},
                {"type": "pty.input", "session_id": "s", "data": b"x"},
                {"type": "pty.ack", "session_id": "s", "channel": "c", "offset": True, "n": 1},
                {"type": "pty.exec", "session_id": "s", "argv": [1], "timeout": 5, "reply_channel": "r"},
                {"type": "pty.exec_stream", "session_id": "s", "exec_id": "../x", "argv": "ls", "timeout": 5},
                {"type": "pty.files", "session_id": "s"},
                {"type": "pty.input", "data": "x"},
                {"type": "pty.anything", "session_id": "s"}):
        with pytest.raises(Malformed):
            command_from_dict(bad)


def test_bytes_in_a_command_are_covered_by_its_seal():
    from protocol.channel import AgentLink, CommandGuard, Refused

    web, guard = AgentLink(node="node-a", key="k"), CommandGuard(node="node-a", key="k")
    chunk = web.command({"type": "pty.files", "session_id": "s", "op": "upload_chunk", "data": b"\x00" * 10, "reply_channel": "r"})
    with pytest.raises(Refused):
        guard.open({**chunk, "data": b"\x01" * 10})
    assert guard.open(chunk)["data"] == b"\x00" * 10


def test_a_direct_stream_offer_is_typed_and_one_out_of_range_is_refused():
    from protocol.channel import DirectOffer, Malformed

    offer = DirectOffer(host="10.0.0.5", port=4000, token="t")
    assert DirectOffer.from_dict(offer.to_dict()) == offer
    assert DirectOffer.from_dict({"type": "terminal.direct", "host": ""}) == DirectOffer(host="")
    for bad in ({"host": "h", "port": 0, "token": "t"}, {"host": "h", "port": "80", "token": "t"},
                {"host": "h", "port": 80}, {"host": 5}):
        with pytest.raises(Malformed):
            DirectOffer.from_dict({"type": "terminal.direct", **bad})
