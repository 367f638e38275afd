"""The session page's "When will I start?" panel in a real browser (issue 17.3), against the
standalone console (tests/test_browser_workloads.py's `console`): bob's session waits behind
the administrator's batch job, which holds the demo node's whole GPU and whose owner's earlier
runs of the same command took 50-70 minutes; bob's page shows the estimate (a band of times), his place in the
queue, which session's end would make room (another user's: no name) and why it waits on each
node; his launch dialog says when a new request would start. When the job is terminated, bob's
session starts and the panel goes away by itself. Screenshots: eta-pending-desktop.png,
eta-launch-preview.png."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT
from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)
from tests.test_browser_workloads import Standalone, browser, log_in, new_page, wait_status  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser

BOB_PASSWORD = "bob-eta-pass-1"
# The browser's locale; with the date before it ("Fri, Nov 27 00:42") where that time falls on another
# day than today (eta.js, clock()): a run in the last hour before midnight.
CLOCK = r"(\S+ \S+ \S+ )?\d{1,2}:\d{2}( [AP]M)?"
SETUP = """
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.utils import timezone
from sessions.models import ComputeSession
admin = get_user_model().objects.get(username="admin")
bob = get_user_model().objects.create_user("bob", password="{password}")
from sessions.models import Project
Project.objects.create(name="nlp").members.add(bob)
now = timezone.now()
for minutes in (50, 60, 70):
    ComputeSession.objects.create(owner=admin, name="train-before", command="sleep 3600", resources={{}},
                                  status="TERMINATED", exit_code=0, started_at=now - timedelta(days=1, minutes=minutes),
                                  terminated_at=now - timedelta(days=1))
"""


@pytest.fixture
def console(procs, tmp_path):
    """The standalone console with the demo node only (one 8 GiB GPU: 2 fGPU)."""
    console = Standalone(procs, tmp_path)
    console.env["FGPU_AGENT_CONFIG"] = str(ROOT / "demo" / "agent.toml")
    console.start()
    return console


def test_a_pending_sessions_page_says_when_it_should_start_and_what_it_waits_for(console, browser):
    from playwright.sync_api import expect

    console.manage(SETUP.format(password=BOB_PASSWORD))
    admin = console.api("admin", ADMIN_PASSWORD)
    bob = console.api("bob", BOB_PASSWORD)
    code, job = admin.call("POST", "/api/v1/sessions/", {"name": "train", "command": "sleep 3600",
                                                        "resources": {"cuda.shares": "2", "mem": "256M"}})
    assert code == 201, job
    wait_status(admin, job["id"], "RUNNING")
    code, mine = bob.call("POST", "/api/v1/sessions/", {"name": "notebook", "resources": {"cuda.shares": "1",
                                                                                          "mem": "256M"}})
    assert code == 201, mine

    page = new_page(browser)
    log_in(page, console.url, username="bob", password=BOB_PASSWORD)
    page.goto(console.url + mine["terminal_url"])
    panel = page.locator("#eta-panel")
    expect(panel).to_be_visible()
    expect(panel.locator(".eta-title")).to_have_text("When will I start?")
    expect(page.locator("#eta-answer")).to_have_attribute("data-outcome", "estimate")
    expect(page.locator("#eta-answer")).to_have_text(re.compile(rf"^Expected to start {CLOCK} – {CLOCK}$"))
    expect(page.locator("#eta-when")).to_have_text(re.compile(r"^in \d+ min to \d+ (min|h)"))
    expect(page.locator("#eta-position")).to_have_text("#1")
    expect(page.locator("#eta-fits")).to_have_text("no")
    after = page.locator("#eta-after li")
    expect(after).to_have_count(1)
    expect(after.locator(".eta-who")).to_have_text("a session of another user")
    expect(after.locator(".eta-where")).to_have_text("on demo-node")
    expect(after.locator(".eta-basis")).to_have_text(re.compile(r"^batch history of this command\b.* \(3 runs\)$"))
    expect(page.locator("#eta-nodes li .eta-node").first).to_have_text("demo-node")
    expect(page.locator("#eta-note")).to_have_text(re.compile(r"^Estimated at .* · updates every 15 s$"))
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot_dir() / "eta-pending-desktop.png"), animations="disabled")

    assert page.js_errors == [], page.js_errors

    # The administrator's project page previews the queue under a new weight before saving it.
    admin_page = new_page(browser)
    log_in(admin_page, console.url, path="/admin/")
    project = next(p for p in admin.call("GET", "/api/v1/projects/")[1]["results"] if p["name"] == "nlp")
    admin_page.goto(f"{console.url}/admin/compute_sessions/project/{project['id']}/change/")
    admin_page.fill("#id_share_weight", "5")
    admin_page.click("#what-if-run")
    expect(admin_page.locator("#what-if-note")).to_have_text(re.compile(r"^Weight 5 \(saved: 1\), replayed at .*"
                                                                        r"Nothing was saved\.$"))
    rows = admin_page.locator("#what-if-rows tr")
    expect(rows).to_have_count(1)
    expect(rows.locator("td").nth(0)).to_have_text("notebook")
    expect(rows.locator("td").nth(3)).to_have_text(re.compile(rf"^\w+ \d+,? {CLOCK} – "))
    expect(rows.locator("td").nth(5)).to_have_text("no change")  # alone in the queue: its weight moves nothing
    admin_page.locator("#what-if").scroll_into_view_if_needed()
    admin_page.screenshot(path=str(screenshot_dir() / "eta-what-if-admin.png"), animations="disabled")
    assert admin_page.js_errors == [], admin_page.js_errors
    assert admin.call("GET", f"/api/v1/projects/{project['id']}/")[1]["share_weight"] == 1  # not saved
    admin_page.context.close()

    # The launch dialog says when a request would start were it launched now (issue 32.4).
    dialog_page = new_page(browser)
    log_in(dialog_page, console.url, username="bob", password=BOB_PASSWORD)
    dialog_page.click("#start-session")
    expect(dialog_page.locator("#launch-dialog")).to_be_visible()
    expect(dialog_page.locator("#preview-line")).to_have_text(re.compile(r"^will wait: "))
    expect(dialog_page.locator("#preview-eta")).to_have_text(
        re.compile(rf"^Expected to start {CLOCK} – {CLOCK} · place 2 in the queue$"))
    dialog_page.locator("#launch-dialog").screenshot(path=str(screenshot_dir() / "eta-launch-preview.png"),
                                                    animations="disabled")
    assert dialog_page.js_errors == [], dialog_page.js_errors
    dialog_page.context.close()

    admin.call("DELETE", f"/api/v1/sessions/{job['id']}/")  # room: bob's session starts, the panel goes
    expect(page.locator("#session-status-badge")).to_have_text("RUNNING")
    expect(panel).to_be_hidden()
    assert page.js_errors == [], page.js_errors
    page.context.close()


MIG_SETUP = """
from django.db import transaction
from accelerators.mig_services import node_mig_settings_apply
from accelerators.models import Node
from tests.stack import wait_until  # not tests.conftest: in a pytest-xdist worker importing it outside pytest refuses
wait_until(lambda: Node.objects.filter(name="demo-mig-node").exists(), timeout=60, interval=0.2, what="the MIG node")
with transaction.atomic():
    node = Node.objects.get(name="demo-mig-node")
    node.mig_mode = "dynamic"
    node.save(update_fields=["mig_mode"])
    node_mig_settings_apply(node=node)
"""


@pytest.fixture
def mig_console(procs, tmp_path):
    """The standalone console with the demo node and the demo MIG node (one mock H100 80GB)."""
    console = Standalone(procs, tmp_path)
    console.env["FGPU_AGENT_CONFIG"] = f"{ROOT / 'demo' / 'agent.toml'},{ROOT / 'demo' / 'agent-mig-h100.toml'}"
    console.start()
    return console


def test_a_waiting_mig_sessions_page_gives_its_band_and_the_smaller_profiles_free_now(mig_console, browser):
    from playwright.sync_api import expect

    console = mig_console
    console.manage(SETUP.format(password=BOB_PASSWORD) + MIG_SETUP)
    admin = console.api("admin", ADMIN_PASSWORD)
    bob = console.api("bob", BOB_PASSWORD)
    code, job = admin.call("POST", "/api/v1/sessions/", {"name": "train", "command": "sleep 3600",
                                                        "resources": {"mig_profile": "4g.40gb", "mem": "256M"}})
    assert code == 201, job
    wait_status(admin, job["id"], "RUNNING")
    code, mine = bob.call("POST", "/api/v1/sessions/", {"name": "whole", "resources": {"mig_profile": "7g.80gb",
                                                                                       "mem": "256M"}})
    assert code == 201, mine

    page = new_page(browser)
    log_in(page, console.url, username="bob", password=BOB_PASSWORD)
    page.goto(console.url + mine["terminal_url"])
    expect(page.locator("#eta-answer")).to_have_attribute("data-outcome", "estimate")
    expect(page.locator("#eta-answer")).to_have_text(re.compile(rf"^Expected to start {CLOCK} – {CLOCK}$"))
    expect(page.locator("#eta-after li .eta-where")).to_have_text("on demo-mig-node")
    expect(page.locator("#eta-mig-now")).to_be_visible()
    expect(page.locator("#eta-mig-now")).to_have_text(
        re.compile(r"^A smaller MIG instance is free now: 3g\.40gb \(39\.5 GiB\), "))
    page.locator("#eta-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot_dir() / "eta-pending-mig.png"), animations="disabled")
    assert page.js_errors == [], page.js_errors
    page.context.close()
