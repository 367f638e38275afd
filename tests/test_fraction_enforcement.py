"""How a node holds a session to its shared GPU slice (issue 13): the agent reports it in its
inventory's attributes (agent/config.py `fraction_enforcement`), the session API and the
session page say it, and plainly so where nothing enforces the fraction."""
from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from accelerators.models import Node
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import ROOT, client_for

pytestmark = pytest.mark.django_db


def launch(user, resources: dict) -> str:
    response = client_for(user).post("/api/v1/sessions/", {"resources": resources}, format="json")
    assert response.status_code == 201, response.content
    schedule_pending()
    return response.json()["id"]


def enforcement(user, session_id: str) -> str:
    response = client_for(user).get(f"/api/v1/sessions/{session_id}/")
    assert response.status_code == 200
    assert response.json()["node"] == "demo-node"
    return response.json()["fraction_enforcement"]


def test_a_shared_slice_says_how_its_node_enforces_it(demo_cluster, alice):
    session_id = launch(alice, {"cuda.shares": "0.5"})

    assert enforcement(alice, session_id) == "none"  # an agent that reports nothing enforces nothing
    Node.objects.filter(name="demo-node").update(attributes={"fraction_enforcement": "hami-core"})
    assert enforcement(alice, session_id) == "hami-core"
    Node.objects.filter(name="demo-node").update(attributes={"fraction_enforcement": "mps"})
    assert enforcement(alice, session_id) == "mps"


def test_a_whole_device_is_no_shared_slice(demo_cluster, alice):
    session_id = launch(alice, {"cuda.shares": "2"})  # the demo GPU is 2 fGPU: all of it

    assert enforcement(alice, session_id) == ""


def test_the_session_page_says_plainly_when_the_fraction_is_not_enforced(demo_cluster, alice):
    session_id = launch(alice, {"cuda.shares": "0.5"})
    browser = Client()
    browser.force_login(alice)
    url = reverse("session-terminal", kwargs={"session_id": session_id})

    assert "fraction not enforced on this node" in browser.get(url).content.decode()
    Node.objects.filter(name="demo-node").update(attributes={"fraction_enforcement": "hami-core"})
    page = browser.get(url).content.decode()
    assert "fraction not enforced" not in page and "enforced by HAMi-core" in page


def test_the_agent_reports_its_enforcement_in_the_inventory(tmp_path):
    from agent.boot import load_inventory
    from agent.config import load_agent_config

    (tmp_path / "mock-accelerator.toml").write_text((ROOT / "demo" / "mock-accelerator.toml").read_text())
    (tmp_path / "agent.toml").write_text('[agent]\nid = "n"\nmps = true\n')
    assert load_inventory(load_agent_config(tmp_path / "agent.toml"))["attributes"]["fraction_enforcement"] == "mps"
