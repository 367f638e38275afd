"""`manage.py standalone` with a keyed agent.toml (`[manager] node-key`): the embedded node's row
takes that key, so the web's commands are sealed with the key the embedded agent verifies them
with, its answers verify, and the web derives the agent's app relay key (protocol.app_relay).
Before, the row kept no key: the web sent its commands unsealed and the keyed agent refused every
one of them (a session never started)."""
from __future__ import annotations

import io

import pytest
from django.core.management.base import CommandError

from accelerators.models import Node
from agent.config import load_agent_config
from console.management.commands.standalone import Command
from protocol.channel import CommandGuard, Refused
from sessions.lifecycle.agent_links import agent_link_named
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

KEY = "k3y-" + "x" * 39  # as long as `manage.py node_key`'s (secrets.token_urlsafe(32))


def configs(tmp_path, key: str | None):
    (tmp_path / "mock-accelerator.toml").write_text((ROOT / "demo" / "mock-accelerator.toml").read_text())
    (tmp_path / "agent.toml").write_text(
        '[agent]\nid = "keyed-node"\nallowed-compute-plugins = ["ai.backend.accelerator.mock"]\n'
        + (f'[manager]\nnode-key = "{key}"\n' if key is not None else "")
    )
    return [load_agent_config(tmp_path / "agent.toml")]


def start(tmp_path, key: str | None) -> str:
    """What a start of standalone does with its nodes' rows (seed, then keys); returns what it said."""
    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    command.demo = "basic"  # as `handle` sets it (not --demo full)
    found = configs(tmp_path, key)
    command._seed_new_nodes(found)
    command._register_node_keys(found)
    return command.stdout.getvalue()


def agent_opens(node_key: str) -> dict:
    """A command the web sends the node now, as the embedded agent with `node_key` opens it."""
    sealed = agent_link_named("keyed-node").command({"type": "pty.app_status", "session_id": "s", "name": "a"})
    return CommandGuard(node="keyed-node", key=node_key).open(sealed)


def test_a_keyed_agent_toml_registers_its_key_so_the_agent_takes_the_webs_commands(tmp_path, monkeypatch):
    monkeypatch.delenv("FGPU_NODE_KEY", raising=False)
    Node.objects.create(name="keyed-node", status="LOST")  # as a start before this one left it: no key
    with pytest.raises(Refused, match="unsigned"):
        agent_opens(KEY)  # what a keyed agent did with the web's commands
    assert start(tmp_path, KEY) == "Node keyed-node: registered its agent.toml node-key.\n"
    assert Node.objects.get(name="keyed-node").agent_key == KEY
    assert agent_opens(KEY)["type"] == "pty.app_status"
    assert start(tmp_path, KEY) == ""  # the next start with the same key: nothing to say
    assert start(tmp_path, None) == "Node keyed-node: has no node-key in agent.toml any more.\n"
    assert Node.objects.get(name="keyed-node").agent_key == ""
    assert agent_opens("")["type"] == "pty.app_status"  # a keyless agent takes unsealed commands


def test_a_key_the_nodes_row_cannot_hold_stops_the_start_saying_why(tmp_path, monkeypatch):
    monkeypatch.delenv("FGPU_NODE_KEY", raising=False)
    with pytest.raises(CommandError, match="node-key is 65 characters, the most a node's key may be is 64"):
        start(tmp_path, "x" * 65)
