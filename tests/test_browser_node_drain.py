"""The admin's node list and node page show a drain in a real browser (issue 37.4): the list's
"drain" column says "draining: 1 session left" and "drained", the node page's Drain part names
who drained it, why and since when, and its Undrain button puts the node back in service (the
Drain button takes it out again, with a reason). Against pytest-django's live server (the real
URLconf, admin and PostgreSQL). Screenshots (in $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/):
admin-node-drain-list.png, admin-node-drain-page.png, admin-node-drain-form.png."""
from __future__ import annotations

import os

import pytest

from accelerators.drain import node_drain
from accelerators.models import Node
from sessions.admission.launch import session_create
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import make_running
from tests.seed import make_cluster, mock_gpu
from tests.test_browser import TIMEOUT_MS, page, screenshot_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "drain-admin-pass-123"


@pytest.fixture
def drained_cluster(django_user_model, alice, live_server):
    """n1 draining with alice's session on it, n2 drained (no session); admin `root` with PASSWORD."""
    make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    node_drain(node_name="n2")
    job = session_create(owner=alice, name="job", resources={"cuda.shares": "1", "mem": "64M"})
    schedule_pending()
    make_running(job)
    node_drain(node_name="n1", reason="driver upgrade", by="root")
    node_drain(node_name="n2", reason="disk swap", by="root")
    django_user_model.objects.create_superuser("root", password=PASSWORD)
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # the ORM reads below run beside Playwright's loop
    return live_server.url


def test_the_node_list_and_page_show_the_drain_and_undrain_reverses_it(drained_cluster, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    base, shots = drained_cluster, screenshot_dir()
    page.goto(base + "/admin/login/?next=/admin/accelerators/node/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")

    rows = page.locator("#result_list tbody tr")
    expect(rows.filter(has_text="n1").locator("td.field-drain_column")).to_have_text("draining: 1 session left")
    expect(rows.filter(has_text="n2").locator("td.field-drain_column")).to_have_text("drained")
    page.screenshot(path=str(shots / "admin-node-drain-list.png"), full_page=True)

    page.get_by_role("link", name="n1", exact=True).click()
    part = page.locator(".field-drain_control")
    expect(part).to_contain_text("draining: 1 session left. Drained by root since")
    expect(part).to_contain_text("UTC: driver upgrade. Its running sessions go on to their end.")
    part.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "admin-node-drain-page.png"))

    part.get_by_role("button", name="Undrain").click()
    expect(page.locator(".messagelist")).to_contain_text("Node n1: in service")
    assert Node.objects.get(name="n1").drain_since is None
    expect(part).to_contain_text("In service: new sessions may be placed here.")
    part.locator("#id_drain_reason").fill("memory test")
    part.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "admin-node-drain-form.png"))
    part.get_by_role("button", name="Drain").click()
    expect(page.locator(".messagelist")).to_contain_text("Node n1: draining: 1 session left")
    node = Node.objects.get(name="n1")
    assert (node.drain_reason, node.drain_evict) == ("memory test", False)
    assert not page.js_errors, page.js_errors
