"""The session page's preemption notice in a real browser (issue 32.2), against the standalone
console (tests/test_browser_workloads.py's `console`) with preemption on and a 5-minute grace:
bob's batch job holds the demo node's whole GPU; the administrator's priority-5 session then
needs it. Bob's page shows a banner (not the header's small reason line) with a countdown that
ticks down each second, the signal his job was sent and that it will be launched again; his log
has the notice line. Desktop screenshot: preemption-notice-desktop.png."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT
from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)
from tests.test_browser_workloads import Standalone, browser, log_in, new_page, wait_status  # noqa: F401  (fixtures)
from tests.stack import wait_until

pytestmark = pytest.mark.browser

BOB_PASSWORD = "bob-preempt-pass-1"
SETUP = """
from django.contrib.auth import get_user_model
get_user_model().objects.create_user("bob", password="{password}")
"""


@pytest.fixture
def console(procs, tmp_path):
    """The standalone console with the demo node only (one 8 GiB GPU: 2 fGPU), preemption on."""
    console = Standalone(procs, tmp_path)
    console.env["FGPU_AGENT_CONFIG"] = str(ROOT / "demo" / "agent.toml")
    console.env["FGPU_PREEMPTION"] = "1"
    console.env["FGPU_PREEMPTION_GRACE_SECONDS"] = "300"
    console.start()
    return console


def test_a_session_under_notice_shows_a_banner_with_a_live_countdown_and_its_signal(console, browser):
    from playwright.sync_api import expect

    console.manage(SETUP.format(password=BOB_PASSWORD))
    admin = console.api("admin", ADMIN_PASSWORD)
    bob = console.api("bob", BOB_PASSWORD)
    code, job = bob.call("POST", "/api/v1/sessions/", {
        "name": "train", "command": "echo training; trap 'echo got USR1' USR1; while true; do sleep 0.2; done",
        "preempt_signal": "USR1", "resources": {"cuda.shares": "2", "mem": "256M"}})
    assert code == 201, job
    wait_status(bob, job["id"], "RUNNING")

    page = new_page(browser)
    log_in(page, console.url, username="bob", password=BOB_PASSWORD)
    page.goto(console.url + job["terminal_url"])
    notice = page.locator("#preempt-notice")
    expect(notice).to_be_hidden()

    code, urgent = admin.call("POST", "/api/v1/sessions/", {"name": "urgent", "priority": 5,
                                                            "resources": {"cuda.shares": "1", "mem": "256M"}})
    assert code == 201, urgent
    expect(notice).to_be_visible(timeout=30_000)  # the pass's notice reaches the page live
    expect(page.locator("#preempt-headline-text")).to_have_text("This session will be preempted in")
    countdown = page.locator("#preempt-countdown")
    expect(countdown).to_have_text(re.compile(r"^[45]:\d\d$"))
    first = countdown.inner_text()
    expect(countdown).not_to_have_text(first, timeout=5_000)  # it ticks
    expect(page.locator("#preempt-signal")).to_have_text("SIGUSR1")
    expect(page.locator("#preempt-reason")).to_contain_text("to make room for urgent of admin (priority 5 over 0)")
    expect(page.locator("#preempt-requeue")).to_contain_text("launched again as a new session")
    expect(page.locator("#session-reason")).to_be_hidden()  # said once, in the banner
    box = notice.bounding_box()
    assert box is not None and box["height"] > 60  # a banner, not a line of small print
    page.screenshot(path=str(screenshot_dir() / "preemption-notice-desktop.png"), animations="disabled")

    log = wait_until(lambda: t if "got USR1" in (t := bob.call("GET", f"/api/v1/sessions/{job['id']}/logs/")[1]["text"])
                     else None, timeout=30, what="the signal in bob's log")
    assert "[fgpu: preemption notice at " in log and ", SIGUSR1 sent: to be preempted at " in log
    assert page.js_errors == [], page.js_errors
    page.context.close()
