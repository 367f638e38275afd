"""The broker's ACL users (common/broker_acl.py, issue 13): no one reaches the broker without a
password, and an agent's user reaches its own queue and the keys its node needs, nothing else.

The end-to-end test runs the distributed stack (uvicorn, manager, beat, two agents) against a
private redis-server loaded with the ACL file, each process with its role's URL, launches a
session and uses its terminal and exec, terminates it, and then reads Redis' ACL log: no
command of a role's user was refused along the way. Then it tries, as one agent, what the ACL
must refuse."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest
import redis

from common.broker_acl import MANAGER, WEB, acl_file, agent_rules, agent_user, broker_users
from tests.conftest import ROOT, wait_until
from tests.stack import Stack, StackNode, mock_inventory
from tests.test_e2e_distributed import api, get_ok, terminal_run


def test_the_acl_file_switches_the_default_user_off_and_stores_no_password_in_clear():
    users = broker_users(["gpu-1", "gpu-2"])
    text = acl_file(users)

    assert text.splitlines()[0] == "user default off"
    assert [line.split()[1] for line in text.splitlines()[1:]] == [WEB, MANAGER, "fgpu-agent-gpu-1", "fgpu-agent-gpu-2"]
    for user in users:
        assert user.password not in text and len(user.password) >= 40
    assert len({u.password for u in users}) == 4


def test_an_agent_reaches_its_own_queue_and_writes_to_the_manager_queues_only():
    rules = agent_rules("gpu-1").split()

    assert "~agent.gpu-1" in rules and {"%W~manager", "%W~manager.logs", "%W~manager.heartbeats"} <= set(rules)
    assert "~manager" not in rules and not any("agent.gpu-2" in r for r in rules)
    assert "~*" not in rules and "resetkeys" in rules and "-@dangerous" in rules


def test_a_node_name_that_no_queue_can_carry_is_refused():
    for bad in ("", "a b", "x*", "-lead", "a" * 129):
        with pytest.raises(ValueError, match="node name"):
            agent_user(bad)
    with pytest.raises(ValueError, match="named twice"):
        broker_users(["n", "n"])


def test_a_url_carries_the_users_name_and_password_quoted():
    user = broker_users(["n"], passwords={WEB: "p@ss/word"})[0]

    assert user.url("redis://broker:6380/2") == "redis://fgpu-web:p%40ss%2Fword@broker:6380/2"


def test_the_command_writes_the_file_private_and_prints_every_role_url(tmp_path):
    out = subprocess.run([sys.executable, "manage.py", "broker_acl", "gpu-1", "--acl-file", str(tmp_path / "users.acl"),
                          "--broker-url", "redis://broker:6379/0"], cwd=ROOT, capture_output=True, text=True)

    assert out.returncode == 0, out.stderr
    assert (tmp_path / "users.acl").stat().st_mode & 0o777 == 0o600
    assert re.search(r"REDIS_URL=redis://fgpu-web:[^@]+@broker:6379/0", out.stdout)
    assert re.search(r'broker-url = "redis://fgpu-agent-gpu-1:[^@]+@broker:6379/0"', out.stdout)
    bad = subprocess.run([sys.executable, "manage.py", "broker_acl", "bad name", "--acl-file", str(tmp_path / "x"),
                          "--broker-url", "redis://broker:6379/0"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "node name" in bad.stderr


@pytest.fixture
def acl_stack(tmp_path):
    # terminal-direct off: the terminal's output takes the channel layer, the path the ACL confines.
    nodes = [StackNode(f"acl-node-{i}", mock_inventory(gpus=1), container="terminal-direct = false") for i in range(2)]
    with Stack(nodes=nodes, work_dir=tmp_path / "stack", broker_acl=True) as stack:
        yield stack


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_stack_runs_with_one_broker_user_per_role_and_an_agent_is_refused_the_rest(acl_stack, django_user_model):
    stack = acl_stack
    from accounts.services import login_token_issue

    token = login_token_issue(user=django_user_model.objects.create_user("alice"))
    status, created = api(stack.base, "POST", "/api/v1/sessions/", token, {"resources": {"cuda.shares": "0.5"}})
    assert status == 201, created
    path = f"/api/v1/sessions/{created['id']}/"
    session = wait_until(lambda: (s := get_ok(stack.base, path, token))["status"] in ("RUNNING", "ERROR") and s,
                         timeout=60, what="the session to start")
    assert session["status"] == "RUNNING", session
    status, ticket = api(stack.base, "POST", f"{path}terminal-ticket/", token, {})
    assert status == 200, ticket
    output = asyncio.run(terminal_run(stack.base.replace("http://", "ws://") + ticket["url"], "echo acl-$((6*7))\r",
                                      "acl-42", timeout=30))
    assert "acl-42" in output
    status, ran = api(stack.base, "POST", f"{path}exec/", token, {"command": "echo exec-ok"})
    assert status == 200 and ran["stdout"] == "exec-ok\n", ran
    status, _ = api(stack.base, "DELETE", path, token)
    assert status == 202
    wait_until(lambda: get_ok(stack.base, path, token)["status"] == "TERMINATED", timeout=30,
               what="the session to end")

    port = stack.redis_port
    admin = redis.Redis(host="127.0.0.1", port=port, username="fgpu-test-admin",
                        password=stack.broker_users["fgpu-test-admin"].password)
    refused = [(e[b"username"], e[b"object"], e[b"reason"]) for e in
               ({k if isinstance(k, bytes) else k.encode(): v for k, v in entry.items()} for entry in admin.acl_log())]
    assert refused == [], f"the ACL refused a role's own work: {refused}"

    me = stack.broker_users[agent_user("acl-node-0")]
    agent = redis.Redis(host="127.0.0.1", port=port, username=me.name, password=me.password)
    assert agent.ping()
    agent.llen("agent.acl-node-0")  # its own queue
    for refused_call in (lambda: agent.lrange("manager", 0, -1),  # reports of every node: write only
                         lambda: agent.llen("agent.acl-node-1"),  # another node's starts and stops
                         lambda: agent.hgetall("unacked"),  # the manager's messages in flight
                         lambda: agent.keys("*"), lambda: agent.flushall(), lambda: agent.acl_list(),
                         lambda: agent.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused_call()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port).ping()  # no credentials: the default user is off
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, username=me.name, password="guess").ping()


def test_an_agent_reaches_the_channel_layer_keys_of_its_own_node_only_and_cannot_list_keys():
    from fnmatch import fnmatchcase

    from protocol.channel import agent_channel_prefix, node_group, node_tag, pty_group, terminal_group

    rules = agent_rules("gpu-1").split()
    readable = [r[1:] for r in rules if r.startswith("~")]
    write_only = [r[3:] for r in rules if r.startswith("%W~")]

    def reaches(key: str, patterns: list[str]) -> bool:
        return any(fnmatchcase(key, p) for p in patterns)

    session = "0b5c0f8e-4b1c-4f5e-9d7e-2f1a3c4b5d6e"
    for own in (f"asgi:group:{pty_group('gpu-1', session)}", f"asgi:group:{terminal_group('gpu-1', session)}",
                f"asgi:group:{node_group('gpu-1')}", "asgiagent.gpu-1.0123abcd!", f"fgpu:exec:gpu-1:{session}:out",
                "unacked.agent.gpu-1", "unacked.agent.gpu-1_index"):
        assert reaches(own, readable), own
    for other in ("gpu-10", "gpu-1.5", "gpu", "gpu-2"):  # names that start alike, with a dot, shorter
        for key in (f"asgi:group:{pty_group(other, session)}", f"asgi:group:{terminal_group(other, session)}",
                    f"asgi:group:{node_group(other)}", f"asgi{agent_channel_prefix(other)}.0123abcd!",
                    f"fgpu:exec:{node_tag(other)}:{session}",
                    f"unacked.agent.{other}", f"agent.{other}"):
            assert not reaches(key, readable) and not reaches(key, write_only), (other, key)
    assert reaches("asgispecific.0123abcd!", write_only) and not reaches("asgispecific.0123abcd!", readable)
    assert reaches("asgireply.app.0123abcd!", write_only) and not reaches("asgireply.app.0123abcd!", readable)
    assert "~asgi*" not in rules and "~fgpu:exec:*" not in rules and "+@keyspace" not in rules
    assert {"-scan", "-keys", "-randomkey", "-dbsize"} <= set(rules)


def test_a_real_broker_gives_an_agent_its_own_unacked_keys_and_refuses_every_other_nodes(tmp_path):
    """kombu keeps an agent's messages in flight under `unacked.agent.N`, `…_index` and `…_mutex`
    (common.broker_acl.agent_transport_options): a redis-server loaded with the ACL file lets node
    gpu-1's user use its own three as kombu does (a hash, a sorted set, a SET NX lock) and refuses
    it, read and write, those of nodes whose names start alike (gpu-10, gpu-1.5), of gpu-2 and of
    the manager (the shared `unacked`): a stolen node credential must not read or ack another
    node's starts and stops."""
    from tests.stack import Proc, free_port

    nodes = ["gpu-1", "gpu-10", "gpu-1.5", "gpu-2"]
    users = {user.name: user for user in broker_users(nodes)}
    (tmp_path / "users.acl").write_text(acl_file(list(users.values())))
    port = free_port()
    server = Proc("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                            "no", "--dir", str(tmp_path), "--aclfile", str(tmp_path / "users.acl")],
                  env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, log_dir=tmp_path)
    try:
        me = users[agent_user("gpu-1")]
        agent = redis.Redis(host="127.0.0.1", port=port, username=me.name, password=me.password, socket_timeout=5)

        def answers() -> bool:
            try:
                return bool(agent.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, timeout=20, what="the ACL broker to answer")
        own = "unacked.agent.gpu-1"
        assert agent.hset(own, "tag-1", "message") == 1 and agent.hget(own, "tag-1") == b"message"
        assert agent.zadd(f"{own}_index", {"tag-1": 1.0}) == 1 and agent.zrange(f"{own}_index", 0, -1) == [b"tag-1"]
        assert agent.set(f"{own}_mutex", "me", nx=True, ex=30) and agent.delete(f"{own}_mutex") == 1
        for other in ("unacked.agent.gpu-10", "unacked.agent.gpu-1.5", "unacked.agent.gpu-2", "unacked"):
            for key, read, write in (
                (other, lambda k: agent.hgetall(k), lambda k: agent.hset(k, "tag-1", "forged")),
                (f"{other}_index", lambda k: agent.zrange(k, 0, -1), lambda k: agent.zadd(k, {"tag-1": 1.0})),
                (f"{other}_mutex", lambda k: agent.get(k), lambda k: agent.set(k, "me", nx=True, ex=30)),
            ):
                for call in (read, write, lambda k: agent.delete(k)):
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        call(key)
    finally:
        server.stop()


def test_every_nodes_group_names_are_valid_channels_names_and_long_or_dotted_names_are_hashed_apart():
    from channels.layers import BaseChannelLayer

    from protocol.channel import node_tag, pty_group, terminal_group

    layer = BaseChannelLayer()
    session = "0b5c0f8e-4b1c-4f5e-9d7e-2f1a3c4b5d6e"
    names = ["n", "gpu-1", "a" * 40, "a" * 41, "a" * 128, "gpu.1", "gpu_1", "A.b-c_d." + "x" * 120]
    for node in names:
        for group in (pty_group(node, session), terminal_group(node, session)):
            assert layer.require_valid_group_name(group) and len(group) < 100, group
        agent_user(node)  # every name a broker user may carry
    tags = [node_tag(n) for n in names]
    assert len(set(tags)) == len(tags) and all("." not in t for t in tags)
    assert node_tag("gpu-1") == "gpu-1" and node_tag("gpu.1").startswith("_") and len(node_tag("a" * 41)) == 41
