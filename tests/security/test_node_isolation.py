"""A stolen node credential reaches that node's sessions and nothing else (issue 31, item 3 and
"Done when": with node B's broker credentials nothing of node A's sessions can be read, typed,
stopped or answered; without credentials nothing at all).

The distributed stack (uvicorn, manager, beat, two agents with node keys) runs against a private
redis-server loaded with `broker_acl`'s ACL file, each process with its role's user. Alice's
session runs on one node (A); the attacker holds the other's (B) broker URL and node key, and
tries what an agent's credentials might reach: each attack FAILS the test if it succeeds. Where
the ACL refuses, the test checks Redis's answer; where a message could reach A's agent some other
way (the harness's own Redis user stands in for a hole in the ACL), the test proves that the agent
ignored it: the session's files show what its terminal ran, in order, and the session stays
RUNNING. Each such check is paired with the same message sealed with A's own key, which does
take effect, so the test can tell an ignored message from a lost one.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from common.broker_acl import agent_user
from common.layers import RedisChannelLayer
from protocol.channel import TO_AGENT, AgentLink, node_group, node_tag, pty_group, seal, terminal_group
from tests.stack import Stack, StackNode, mock_inventory, wait_until
from tests.test_e2e_distributed import api, get_ok

pytestmark = pytest.mark.e2e
NODES = ("iso-a", "iso-b")


@pytest.fixture
def attack(tmp_path, django_user_model):
    """The stack, alice's RUNNING session, its node (A), the other node (B) and what B's agent
    holds: `(stack, token, session id, a, b, b_url, b_key)`."""
    from accounts.services import api_token_create

    nodes = [StackNode(name, mock_inventory(gpus=1)) for name in NODES]
    with Stack(nodes=nodes, work_dir=tmp_path / "stack", broker_acl=True, node_keys=True) as stack:
        token, _ = api_token_create(user=django_user_model.objects.create_user("alice"), name="isolation")
        status, created = api(stack.base, "POST", "/api/v1/sessions/", token, {"resources": {"cuda.shares": "0.5"}})
        assert status == 201, created
        path = f"/api/v1/sessions/{created['id']}/"
        session = wait_until(
            lambda: (s := get_ok(stack.base, path, token))["status"] in ("RUNNING", "ERROR") and s,
            timeout=60,
            what="the session to start",
        )
        assert session["status"] == "RUNNING", session
        a = session["node"]
        b = next(n for n in NODES if n != a)
        b_url = stack.broker_users[agent_user(b)].url(f"redis://127.0.0.1:{stack.redis_port}/0")
        yield stack, token, created["id"], a, b, b_url, stack.node_keys[b]


def exec_stdout(stack: Stack, token: str, session_id: str, command: str) -> str:
    status, ran = api(stack.base, "POST", f"/api/v1/sessions/{session_id}/exec/", token, {"command": command})
    assert status == 200, ran
    return ran["stdout"]


def acl_refusal(exc: Exception) -> bool:
    """Whether Redis refused a command (or a script's command) for the user's ACL."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or "can't access" in str(exc)


def admin_send(stack: Stack, group: str, message: dict) -> None:
    """`message` into `group` with the harness's own Redis user: a hole in the ACL, made on purpose."""
    url = stack.broker_users["fgpu-test-admin"].url(f"redis://127.0.0.1:{stack.redis_port}/0")

    async def send():
        layer = RedisChannelLayer(hosts=[{"address": url}])
        await layer.group_send(group, message)

    asyncio.run(send())


@pytest.mark.django_db(transaction=True)
def test_node_bs_broker_user_cannot_list_the_keyspace_or_read_node_as_keys(attack):
    stack, token, session_id, a, b, b_url, _ = attack
    thief = redis.Redis.from_url(b_url)
    assert thief.ping()
    # Something of A's in the exec store and the channel layer, to make sure the keys exist.
    status, started = api(
        stack.base, "POST", f"/api/v1/sessions/{session_id}/exec/", token, {"command": "echo secret-of-a", "stream": True}
    )
    assert status in (200, 201, 202), started
    mine = f"asgi:group:pty.{node_tag(b)}.x"
    thief.zadd(mine, {"probe": 1})  # its own keys: reachable (the refusals below are not a broken user)
    assert thief.zrange(mine, 0, -1) == [b"probe"]

    for attempt in (
        lambda: thief.scan(0),
        lambda: thief.keys("*"),
        lambda: thief.randomkey(),
        lambda: thief.dbsize(),
        lambda: thief.zrange(f"asgi:group:{pty_group(a, session_id)}", 0, -1),
        lambda: thief.zrange(f"asgi:group:{terminal_group(a, session_id)}", 0, -1),
        lambda: thief.zrange(f"asgi:group:{node_group(a)}", 0, -1),
        lambda: thief.zpopmin(f"asgiagent.{node_tag(a)}.0123456789abcdef!"),  # A's agent's messages
        lambda: thief.zrange("asgispecific.0123456789abcdef!", 0, -1),  # terminals' output, scrollback
        lambda: thief.zpopmin("asgireply.app.0123456789abcdef!"),  # the web's app questions' answers
        lambda: thief.hgetall(f"fgpu:exec:{node_tag(a)}:{started['id']}"),
        lambda: thief.lrange(f"fgpu:exec:{node_tag(a)}:{started['id']}:out", 0, -1),
        lambda: thief.llen(f"agent.{a}"),
        lambda: thief.hgetall(f"unacked.agent.{a}"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=stack.redis_port).ping()  # no credentials: nothing at all


@pytest.mark.django_db(transaction=True)
def test_node_b_cannot_join_or_write_node_as_groups_and_channels(attack):
    stack, token, session_id, a, b, b_url, b_key = attack

    async def attempts():
        layer = RedisChannelLayer(hosts=[{"address": b_url}])
        mine = await layer.new_channel(f"agent.{node_tag(b)}")
        refused = []
        for group in (pty_group(a, session_id), terminal_group(a, session_id), node_group(a)):
            try:
                await layer.group_add(group, mine)  # to read A's commands, output or node questions
            except redis.exceptions.ResponseError as exc:
                refused.append(("join", group, acl_refusal(exc)))
        forged = AgentLink(node=a, key=b_key)
        for kind, extra in (
            ("pty.input", {"data": "echo typed-by-b >> isolation.txt\r"}),
            ("pty.stop", {}),
            ("pty.exec", {"argv": "touch exec-by-b", "timeout": 5, "reply_channel": mine}),
            (
                "pty.app_open",
                {
                    "app": {"name": "x", "command": "sleep 1", "port": 1, "base_url": "/"},
                    "base_url": "/",
                    "token": "t",
                    "timeout": 5,
                    "reply_channel": mine,
                },
            ),
        ):
            try:
                await layer.group_send(
                    pty_group(a, session_id), forged.command({"type": kind, "session_id": session_id, **extra})
                )
            except redis.exceptions.ResponseError as exc:
                refused.append(("send", kind, acl_refusal(exc)))
        try:  # A's agent's own channel (its name is random, but the key's pattern is refused whole)
            await layer.send(f"agent.{node_tag(a)}.0123456789abcdef!x", {"type": "pty.stop", "session_id": session_id})
        except redis.exceptions.ResponseError as exc:
            refused.append(("send", "agent channel", acl_refusal(exc)))
        return refused

    refused = asyncio.run(attempts())

    assert len(refused) == 8 and all(r[2] for r in refused), f"node B reached node A's channel layer: {refused}"
    status = get_ok(stack.base, f"/api/v1/sessions/{session_id}/", token)["status"]
    assert status == "RUNNING"
    assert "exec-by-b" not in exec_stdout(stack, token, session_id, "ls")


@pytest.mark.django_db(transaction=True)
def test_node_as_agent_ignores_commands_not_sealed_with_its_own_key(attack):
    stack, token, session_id, a, b, _, b_key = attack
    group = pty_group(a, session_id)
    own = AgentLink(node=a, key=stack.node_keys[a])
    forged = AgentLink(node=a, key=b_key)
    unsigned = AgentLink(node=a)

    def typed(link: AgentLink, line: str) -> dict:
        return link.command({"type": "pty.input", "session_id": session_id, "data": f"echo {line} >> isolation.txt\r"})

    admin_send(stack, group, typed(forged, "forged-by-b"))
    admin_send(stack, group, typed(unsigned, "unsigned"))
    admin_send(stack, group, forged.command({"type": "pty.stop", "session_id": session_id}))
    admin_send(stack, group, unsigned.command({"type": "pty.stop", "session_id": session_id}))
    stale = seal(
        {"type": "pty.input", "session_id": session_id, "data": "echo stale >> isolation.txt\r"},
        key=own.key,
        node=a,
        direction=TO_AGENT,
        now=time.time() - 120,
    )  # one of A's, two minutes old
    admin_send(stack, group, stale)
    genuine = typed(own, "genuine")
    admin_send(stack, group, genuine)
    admin_send(stack, group, genuine)  # the same sealed message again: a replay
    admin_send(stack, group, typed(own, "after"))

    seen = wait_until(
        lambda: (t := exec_stdout(stack, token, session_id, "cat isolation.txt 2>/dev/null")).endswith("after\n") and t,
        timeout=30,
        what="the session's own commands to take effect",
    )

    assert seen == "genuine\nafter\n", f"node A's agent acted on commands not sealed with its key: {seen!r}"
    assert get_ok(stack.base, f"/api/v1/sessions/{session_id}/", token)["status"] == "RUNNING"
    log = stack.procs[Stack.agent_name(a)].output()
    assert log.count("dropped a 'pty.stop' message") == 2, log[-3000:]
    assert "replayed" in log and "from now" in log, log[-3000:]


def test_a_key_from_node_b_does_not_pass_for_node_a_either_way():
    """The seal names its node and direction: B's key, or A's answer played back as a command, fail."""
    from protocol.channel import CommandGuard, Refused

    a_agent, b_key = CommandGuard(node="iso-a", key="a" * 43), "b" * 43
    web = AgentLink(node="iso-a", key="a" * 43)
    with pytest.raises(Refused):
        a_agent.open(AgentLink(node="iso-a", key=b_key).command({"type": "pty.stop", "session_id": "s"}))
    with pytest.raises(Refused):  # an answer of A's agent, sent back to it as a command
        a_agent.open(a_agent.answer({"type": "pty.stop", "session_id": "s"}))
    with pytest.raises(Refused):  # a forged app answer pointing the web at B's listener
        web.answer(
            CommandGuard(node="iso-a", key=b_key).answer(
                {"type": "app.status", "running": True, "host": "10.0.0.66", "port": 8888}
            )
        )
    with pytest.raises(Refused):
        web.answer({"type": "app.status", "running": True, "host": "10.0.0.66", "port": 8888})  # unsigned
    assert web.answer(a_agent.answer({"type": "app.status", "host": "h"}))["host"] == "h"
    genuine = AgentLink(node="iso-a", key="a" * 43).command({"type": "pty.stop", "session_id": "s"})
    assert a_agent.open(genuine) == {"type": "pty.stop", "session_id": "s"}
    with pytest.raises(Refused, match="replayed"):
        a_agent.open(genuine)
    old = AgentLink(node="iso-a", key="a" * 43)
    with pytest.raises(Refused, match="from now"):
        a_agent.open(seal_at(old, time.time() - 61))


def seal_at(link: AgentLink, when: float) -> dict:
    return seal({"type": "pty.stop", "session_id": "s"}, key=link.key, node=link.node, direction=TO_AGENT, now=when)


@pytest.mark.django_db(transaction=True)
def test_the_web_sends_no_app_request_to_a_listener_named_by_an_answer_its_node_did_not_seal(alices_session):
    """Answering the web's `pty.app_status` first, with another node's key or none, names no
    listener: the web waits for the answer that the session's own node sealed."""
    from channels.layers import get_channel_layer

    from accelerators.models import Node
    from protocol.channel import CommandGuard
    from sessions.serving.session_apps import session_app_target

    node = alices_session.node.name
    Node.objects.filter(name=node).update(agent_key="a" * 43)
    own, other = CommandGuard(node=node, key="a" * 43), CommandGuard(node=node, key="b" * 43)
    session_id = str(alices_session.pk)

    async def scenario():
        layer = get_channel_layer()
        agent = await layer.new_channel()
        await layer.group_add(pty_group(node, session_id), agent)
        asked = asyncio.create_task(session_app_target(session_id=session_id, name="isolation-app", port=8888))
        question = own.open(await asyncio.wait_for(layer.receive(agent), 10))  # sealed with the node's key
        reply = question["reply_channel"]
        status = {"type": "app.status", "running": True}
        await layer.send(reply, other.answer({**status, "host": "10.66.0.1", "port": 6666}))  # node B's key
        await layer.send(reply, {**status, "host": "10.66.0.2", "port": 6667})  # unsealed
        await layer.send(reply, own.answer({**status, "host": "127.0.0.1", "port": 8888}))
        return question, await asyncio.wait_for(asked, 10)

    question, target = asyncio.run(scenario())

    assert question["type"] == "pty.app_status" and question["session_id"] == session_id
    assert target == ("127.0.0.1", 8888), f"the web took a forged answer: {target}"
