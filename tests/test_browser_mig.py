"""MIG in the launch dialog, in a real browser, against the console as `make run` starts it with
the demo's second, MIG node: `FGPU_AGENT_CONFIG=demo/agent.toml,demo/agent-mig-h100.toml`.

An administrator sets `demo-mig-node` (one mock H100 80GB) to dynamic MIG in the admin, as the
demo's agent-mig-h100.toml tells them to. Then, in the launch dialog, the MIG tab lists the
H100's profiles with their memory and what is free now; launching a 2g.20gb from it ends with a
RUNNING session on a 2g.20gb instance. In the Memory + cores tab the isolation choice appears:
15 GiB as a "MIG instance" is previewed and launched as the smallest instance that holds it,
1g.20gb. The list shows each session's profile and why it got it; the API's refusal of pinned
GPUs for a MIG request shows beside the field and in the dialog.

Screenshots go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/: launch-tab-mig.png,
launch-tab-memory-isolation.png, launch-mig-error.png, session-list-mig.png.
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT
from tests.test_browser import screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_launch_styles import log_in_and_open_the_dialog

pytestmark = pytest.mark.browser

AGENTS = f"{ROOT / 'demo' / 'agent.toml'},{ROOT / 'demo' / 'agent-mig-h100.toml'}"


@pytest.fixture
def mig_console_url(monkeypatch, request):
    """The standalone console with the demo node and the demo MIG node (its agent.toml files)."""
    monkeypatch.setenv("FGPU_AGENT_CONFIG", AGENTS)
    return request.getfixturevalue("console_url")


def log_in_and_set_dynamic_mig(page, base):
    """Log in (the launch-styles test's steps), then set demo-mig-node to dynamic MIG in the admin."""
    from playwright.sync_api import expect

    log_in_and_open_the_dialog(page, base).press("Escape")
    page.goto(base + "/admin/accelerators/node/")
    page.get_by_role("link", name="demo-mig-node", exact=True).click()
    page.select_option("#id_mig_mode", "dynamic")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text("demo-mig-node")
    page.goto(base + "/sessions/")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")


def open_dialog(page):
    from playwright.sync_api import expect

    page.click("#start-session")
    expect(page.locator("#launch-dialog")).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    return page.locator("#launch-dialog")


def launch_and_wait_running(page, expected_resources: dict) -> dict:
    """Click Launch; check the body sent; wait for the row to turn RUNNING; the session's JSON."""
    from playwright.sync_api import expect

    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    assert info.value.request.post_data_json["resources"] == expected_resources
    created = info.value.json()
    assert info.value.status == 201, created
    expect(page.locator("#launch-dialog")).to_be_hidden()
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    answer = page.request.get(page.url.split("/sessions/")[0] + f"/api/v1/sessions/{created['id']}/")
    assert answer.ok, answer.text()
    return answer.json()


def test_launching_by_mig_profile_and_by_memory_with_mig_isolation_from_the_dialog(mig_console_url, page):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    log_in_and_set_dynamic_mig(page, mig_console_url)
    page.js_errors.clear()  # the admin pages ask for a /favicon.ico there is none of (404)
    dialog = open_dialog(page)

    # The MIG tab is there because a dynamic-MIG node is in reach; it is the last tab.
    tab = page.locator("#tab-mig")
    expect(tab).to_be_visible()
    page.focus("#tab-fgpu")
    page.keyboard.press("End")
    expect(tab).to_be_focused()
    expect(tab).to_have_attribute("aria-selected", "true")
    expect(page.locator("#panel-mig")).to_be_visible()
    expect(page.locator("#launch-advanced")).to_be_hidden()  # MIG instances are never pinned

    # One row per H100 profile, smallest first, with its memory and what is free now.
    rows = page.locator("#mig-profiles .mig-profile")
    expect(rows).to_have_count(7)
    expect(rows.locator(".mig-name")).to_have_text(
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"])
    two = page.locator('.mig-profile:has(input[value="2g.20gb"])')
    expect(two.locator(".mig-memory")).to_have_text("19.62 GiB")
    expect(two.locator(".mig-avail")).to_have_text("3 free now")
    expect(page.locator('.mig-profile:has(input[value="1g.10gb"]) .mig-avail')).to_have_text("7 free now")

    two.click()
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-mig-node")
    expect(page.locator("#preview-config")).to_have_text("MIG 2g.20gb · 1 core · 1 GiB")
    expect(page.locator("#preview-mig")).to_have_text(re.compile(r"^Gets MIG 2g\.20gb: creates a 2g\.20gb instance"))
    expect(page.locator("#preview-devices tbody tr").first).to_contain_text("MIG 2g.20gb")
    expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
    dialog.screenshot(path=str(shots / "launch-tab-mig.png"), animations="disabled")

    first = launch_and_wait_running(page, {"mig_profile": "2g.20gb", "cpu": 1, "mem": "1G"})
    assert (first["mig_profile"], first["node"]) == ("2g.20gb", "demo-mig-node")
    row = page.locator(f'#sessions-table tr[data-session-id="{first["id"]}"]')
    expect(row.locator(".mig-chip")).to_have_text("MIG 2g.20gb")
    expect(row.locator(".config-grant")).to_have_text(re.compile(r"^got MIG 2g\.20gb on GPU 0 \(memory slices \d–\d\): "
                                                                 r"the profile asked for$"))

    # Memory + cores: the isolation choice, 15 GiB as a MIG instance is the smallest that holds it.
    open_dialog(page)
    expect(page.locator('.mig-profile:has(input[value="2g.20gb"]) .mig-avail')).to_have_text("2 free now")
    page.click("#tab-memory")
    isolation = page.locator("#isolation-field")
    expect(isolation).to_be_visible()
    expect(page.locator("#isolation-hint")).to_contain_text("shared GPU")
    page.get_by_label("MIG instance").check()
    expect(page.locator("#isolation-hint")).to_contain_text("smallest MIG instance")
    expect(page.locator("#gpu-cores")).to_be_hidden()  # one GPU, its compute set by the profile
    expect(page.locator("#gpu-count-hami")).to_be_hidden()
    page.fill("#gpu-memory", "15G")
    expect(page.locator("#preview-config")).to_have_text("MIG instance of at least 15 GiB · 1 core · 1 GiB")
    expect(page.locator("#preview-mig")).to_have_text(re.compile(r"^Gets MIG 1g\.20gb: "))
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-mig-node")
    expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
    dialog.screenshot(path=str(shots / "launch-tab-memory-isolation.png"), animations="disabled")

    # The API's refusal shows beside the field it names and, on Launch, in the dialog.
    page.click("#launch-advanced summary")
    page.fill("#pin-devices", "0")
    expect(page.locator("#pin-devices-error")).to_contain_text("MIG instances are chosen by the scheduler")
    expect(page.locator("#launch-preview")).to_have_attribute("data-state", "invalid")
    page.click("#launch-submit")
    expect(page.locator("#launch-error")).to_be_visible()
    expect(page.locator("#launch-error")).to_contain_text("MIG instances are chosen by the scheduler")
    dialog.screenshot(path=str(shots / "launch-mig-error.png"), animations="disabled")
    page.fill("#pin-devices", "")
    expect(page.locator("#pin-devices-error")).to_be_hidden()

    second = launch_and_wait_running(page, {"gpu_memory": "15G", "isolation": "mig", "cpu": 1, "mem": "1G"})
    assert (second["mig_profile"], second["node"]) == ("1g.20gb", "demo-mig-node")
    assert second["requested"] == "MIG instance of at least 15 GiB · 1 core · 1 GiB"
    row = page.locator(f'#sessions-table tr[data-session-id="{second["id"]}"]')
    expect(row.locator(".mig-chip")).to_have_text("MIG 1g.20gb")
    expect(row.locator(".config-grant")).to_contain_text("the smallest MIG instance that holds 15 GiB")
    page.screenshot(path=str(shots / "session-list-mig.png"), animations="disabled")

    # The session's page says which slice it got.
    page.goto(mig_console_url + f"/sessions/{second['id']}/terminal/")
    expect(page.locator("#session-slice")).to_contain_text("MIG 1g.20gb")
    expect(page.locator("#session-configuration")).to_contain_text("got MIG 1g.20gb on GPU 0")

    # The only console errors are the browser's notes of the refusals above (preview and launch: 400).
    refused = "Failed to load resource: the server responded with a status of 400 (Bad Request)"
    assert [e for e in page.js_errors if not e.endswith(refused)] == [], page.js_errors
