"""The launch dialog's request-style tabs in a real browser, against the console as `make run` starts it.

Same standalone console and chromium as tests/test_browser.py (demo-node: one 8 GiB, 80-SM GPU).
A user picks "Memory + cores", asks for 1 GPU with 2 GiB and 25 % of its SMs, sees the server's
preview (starts now on demo-node, 2 GiB and 20 SMs on GPU 0) and launches; the row shows that
request. Obvious mistakes (cores of 150, a fraction above 1, no memory) are caught beside the
field and keep Launch disabled; the server's verdicts (too large) come through the preview.

Screenshots of each tab go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/.
"""
from __future__ import annotations

import re

import pytest

from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser


def log_in_and_open_the_dialog(page, console_url):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    page.goto(console_url + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(console_url + "/sessions/")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")
    page.click("#start-session")
    expect(page.locator("#launch-dialog")).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    return page.locator("#launch-dialog")


def test_a_memory_and_cores_request_shows_its_preview_and_launches_with_that_configuration(console_url, page):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    dialog = log_in_and_open_the_dialog(page, console_url)
    preview = page.locator("#launch-preview")

    # The fGPU tab is the default and previews the slider's 0.5 fGPU.
    expect(page.locator("#tab-fgpu")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    dialog.screenshot(path=str(shots / "launch-tab-fgpu.png"), animations="disabled")

    # Every request style has its tab; one the cluster cannot serve says why instead of its fields,
    # and nothing can be launched from it: demo-node's slot is fractional and no GPU serves MIG.
    for tab, words in (("#tab-devices", "shared in fractions here"), ("#tab-mig", "No GPU in reach serves MIG")):
        expect(page.locator(tab)).to_be_visible()
        expect(page.locator(tab)).to_have_class(re.compile(r"\btab-unavailable\b"))
        page.click(tab)
        expect(page.locator("#style-note")).to_contain_text(words)
        expect(page.locator("#launch-submit")).to_be_disabled()
        expect(page.locator("#launch-preview")).to_be_hidden()
        expect(page.locator("#launch-advanced")).to_be_hidden()
        if tab == "#tab-mig":
            dialog.screenshot(path=str(shots / "launch-tab-unavailable.png"), animations="disabled")
    page.click("#tab-fgpu")
    expect(page.locator("#style-note")).to_be_hidden()
    expect(page.locator("#launch-submit")).to_be_enabled()
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")

    page.click("#tab-memory")
    expect(page.locator("#tab-memory")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#panel-memory")).to_be_visible()
    expect(page.locator("#panel-fgpu")).to_be_hidden()
    page.fill("#gpu-count-hami", "1")
    page.fill("#gpu-memory", "2G")
    page.fill("#gpu-cores", "25")

    # The server's preview: the slice on demo-node's GPU 0, 2 GiB and a quarter of its 80 SMs.
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    expect(preview).to_have_attribute("data-state", "now")
    expect(page.locator("#preview-config")).to_contain_text("2 GiB")
    rows = page.locator("#preview-devices tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("GPU 0")
    expect(rows.first).to_contain_text("2 GiB")
    expect(rows.first).to_contain_text("20\u00a0SMs")
    expect(rows.first).to_contain_text("25\u00a0%")
    expect(preview).not_to_have_attribute("aria-busy", "true")
    configuration = page.locator("#preview-config").text_content()
    dialog.screenshot(path=str(shots / "launch-tab-memory.png"), animations="disabled")

    # Launch sends exactly this style plus name, cpu and mem, and the image picked (the default, host).
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    assert info.value.request.post_data_json == {
        "name": "session-1",
        "resources": {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 25, "cpu": 1, "mem": "1G"},
        "image": "host",
    }
    created = info.value.json()
    assert info.value.status == 201, created
    expect(dialog).to_be_hidden()
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row.locator("td.configuration")).to_have_text(configuration)
    expect(row.locator("td.configuration")).to_contain_text("2 GiB")
    expect(row.locator("td.status")).to_have_text("RUNNING")
    expect(row.locator("td.node")).to_contain_text("GPU 0")

    # A running session's name is taken (issue 36.6): the preview and Launch say so beside the name.
    page.click("#start-session")
    expect(dialog).to_be_visible()
    expect(page.locator("#session-name")).to_have_value("session-2")
    page.fill("#session-name", "session-1")
    taken = "you already have a session named 'session-1' that has not ended (RUNNING)"
    expect(page.locator("#session-name-error")).to_contain_text(taken)
    expect(page.locator("#session-name")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#preview-line")).to_have_text("not valid: name in use")
    expect(page.locator("#launch-submit")).to_be_disabled()
    dialog.screenshot(path=str(shots / "launch-name-taken.png"), animations="disabled")
    page.fill("#session-name", "session-2")
    expect(page.locator("#session-name-error")).to_be_hidden()
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")

    assert page.js_errors == [], page.js_errors


def test_obvious_mistakes_are_shown_beside_their_field_and_keep_launch_disabled(console_url, page):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    dialog = log_in_and_open_the_dialog(page, console_url)
    launch = page.locator("#launch-submit")

    # The tabs follow the keyboard: arrows move and select, Home and End jump, over every tab
    # (Whole GPUs and MIG, which this cluster cannot serve, say so when selected).
    page.focus("#tab-fgpu")
    page.keyboard.press("ArrowRight")
    expect(page.locator("#tab-devices")).to_be_focused()
    expect(page.locator("#style-note")).to_be_visible()
    page.keyboard.press("ArrowRight")
    expect(page.locator("#tab-memory")).to_be_focused()
    expect(page.locator("#tab-memory")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#panel-memory")).to_be_visible()
    expect(page.locator("#style-note")).to_be_hidden()
    page.keyboard.press("End")
    expect(page.locator("#tab-mig")).to_be_focused()
    page.keyboard.press("ArrowLeft")
    expect(page.locator("#tab-fraction")).to_be_focused()
    expect(page.locator("#panel-fraction")).to_be_visible()
    page.keyboard.press("Home")
    expect(page.locator("#tab-fgpu")).to_be_focused()
    page.keyboard.press("ArrowLeft")
    expect(page.locator("#tab-mig")).to_be_focused()
    page.keyboard.press("ArrowLeft")
    expect(page.locator("#tab-fraction")).to_be_focused()
    expect(page.locator("#tab-fraction")).to_have_attribute("aria-selected", "true")

    # A fraction must be above 0 and at most 1.
    page.fill("#gpu-fraction", "1.5")
    expect(page.locator("#gpu-fraction-error")).to_be_visible()
    expect(launch).to_be_disabled()
    page.fill("#gpu-fraction", "0.25")
    expect(page.locator("#gpu-fraction-error")).to_be_hidden()
    expect(launch).to_be_enabled()
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    expect(page.locator("#preview-devices tbody tr").first).to_contain_text("2 GiB")  # a quarter of 8 GiB
    dialog.screenshot(path=str(shots / "launch-tab-fraction.png"), animations="disabled")

    # Cores are a percentage: 150 is refused beside the field, before any request.
    page.click("#tab-memory")
    page.fill("#gpu-cores", "150")
    error = page.locator("#gpu-cores-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("0 to 100")
    expect(page.locator("#gpu-cores")).to_have_attribute("aria-invalid", "true")
    expect(launch).to_be_disabled()
    expect(page.locator("#launch-preview")).to_be_hidden()
    page.fill("#gpu-memory", "")
    expect(page.locator("#gpu-memory-error")).to_be_visible()
    dialog.screenshot(path=str(shots / "launch-field-errors.png"), animations="disabled")

    page.fill("#gpu-cores", "25")
    page.fill("#gpu-memory", "2G")
    expect(error).to_be_hidden()
    expect(page.locator("#gpu-memory-error")).to_be_hidden()
    expect(launch).to_be_enabled()

    # What only the server knows comes through the preview: demo-node has one GPU.
    # Too large in three lines (issue 36.6): what was asked, the most any node gives, what to do.
    page.fill("#gpu-count-hami", "2")
    expect(page.locator("#launch-preview")).to_have_attribute("data-state", "never")
    expect(page.locator("#preview-line")).to_have_text("too large for any node")
    expect(page.locator("#preview-never li")).to_have_text([
        "cuda: 2 GPUs asked, each with 2 GiB and 25% of its cores.",
        "The most one node can give is 1 such GPU (demo-node).",
        "Ask for at most 1 GPU per session (a session runs on one node).",
    ])
    expect(launch).to_be_disabled()
    dialog.screenshot(path=str(shots / "launch-too-large.png"), animations="disabled")
    page.fill("#gpu-count-hami", "1")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")

    # The advanced options travel with any style; a CPU-only pick hides the tabs.
    page.click("#launch-advanced summary")
    page.select_option("#policy-select", "spread")
    page.check("#numa-only")
    # A pinned device no node has is said to be that, beside the field, not "too large" (issue 36.6).
    page.fill("#pin-devices", "GPU-nope")
    expect(page.locator("#preview-line")).to_have_text("cannot launch: no registered node has a device GPU-nope.")
    expect(page.locator("#pin-devices-error")).to_contain_text("no registered node has a device GPU-nope")
    expect(page.locator("#pin-devices")).to_have_attribute("aria-invalid", "true")
    expect(launch).to_be_disabled()
    dialog.screenshot(path=str(shots / "launch-unknown-device.png"), animations="disabled")
    page.fill("#pin-devices", "0")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    expect(page.locator("#pin-devices-error")).to_be_hidden()
    dialog.screenshot(path=str(shots / "launch-advanced.png"), animations="disabled")
    # The request this edit sends (a preview still due from the edits above may go first).
    with page.expect_request(lambda r: r.url.endswith("/api/v1/sessions/preview/")
                             and (r.post_data_json or {}).get("resources", {}).get("gpu_memory") == "1G") as sent:
        page.fill("#gpu-memory", "1G")
    assert sent.value.post_data_json["resources"] == {
        "gpu": 1, "gpu_memory": "1G", "gpu_cores": 25, "devices": [0], "policy": "spread", "numa": True,
        "cpu": 1, "mem": "1G",
    }
    page.select_option("#slot-select", "")
    expect(page.locator("#style-tabs")).to_be_hidden()

    assert page.js_errors == [], page.js_errors
