"""Resource presets in the launch dialog, in a real browser, against the console as `make run`
starts it (tests/test_browser.py: standalone, demo-node with one 8 GiB / 80-SM GPU = 2 fGPU,
4 cores, 16 GiB).

An administrator defines two presets through the API. The dialog offers them first (with
Custom); picking "Small notebook" fills the fGPU tab, CPU cores and host memory, the preview
shows its request, and Launch sends just the preset: the session gets exactly its request.
Picking "Memory slice" and raising its cores sends the preset with the changed GPU request.
Screenshots of the dialog at 1280×800 and 390×844 go to $FGPU_SCREENSHOT_DIR, else
<repo>/screenshots/."""
from __future__ import annotations

import pytest

from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_images import api_post
from tests.test_browser_launch_styles import log_in_and_open_the_dialog

pytestmark = pytest.mark.browser

GiB = 1 << 30


def launched(page) -> dict:
    """Click Launch; the POST's body and the session it answered."""
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    assert info.value.status == 201, info.value.text()
    return {"body": info.value.request.post_data_json, "session": info.value.json()}


def test_a_preset_picked_in_the_dialog_fills_the_request_and_launches_exactly_it(console_url, page):
    from playwright.sync_api import expect

    token = api_post(console_url, "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})["token"]
    small = api_post(console_url, "/api/v1/presets/", {
        "name": "Small notebook", "description": "A quarter GPU for notebooks", "resources": {"cuda.shares": "0.25"},
        "cpu": 2, "mem": "8G"}, token)
    memory = api_post(console_url, "/api/v1/presets/", {
        "name": "Memory slice", "description": "2 GiB and a quarter of the SMs of one GPU",
        "resources": {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 25}, "mem": "2G"}, token)

    dialog = log_in_and_open_the_dialog(page, console_url)
    options = page.locator("#preset-options .preset-option")
    expect(page.locator("#preset-field")).to_be_visible()
    expect(options).to_have_count(3)
    expect(options.nth(0)).to_contain_text("Custom")
    expect(options.nth(1)).to_contain_text("Memory slice")
    expect(options.nth(2).locator(".preset-name")).to_have_text("Small notebook")
    expect(options.nth(2).locator(".preset-description")).to_have_text("A quarter GPU for notebooks")
    expect(options.nth(2).locator(".preset-request")).to_have_text("0.25 fGPU · 2 cores · 8 GiB")
    expect(page.locator("#preset-custom")).to_be_checked()

    # Picking it fills the fGPU tab, cores and memory; the preview shows its request.
    options.nth(2).click()
    expect(page.locator(f"#preset-{small['id']}")).to_be_checked()
    expect(page.locator("#tab-fgpu")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#fgpu-slider")).to_have_value("0.25")
    expect(page.locator("#fgpu-readout")).to_have_text("0.25 fGPU")
    expect(page.locator("#cpu-count")).to_have_value("2")
    expect(page.locator("#mem-size")).to_have_value("8G")
    expect(page.locator("#preset-hint")).to_have_text("Filled in below from Small notebook. What you change replaces "
                                                      "that part of the preset.")
    expect(page.locator("#preview-config")).to_have_text("0.25 fGPU · 2 cores · 8 GiB")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
    dialog.screenshot(path=str(screenshot_dir() / "launch-preset-desktop.png"), animations="disabled")

    first = launched(page)
    assert first["body"] == {"name": "session-1", "preset": small["id"]}
    assert first["session"]["resources"] == small["request"] == {"cuda.shares": "0.25", "cpu": 2, "mem": 8 * GiB}
    row = page.locator(f'tr[data-session-id="{first["session"]["id"]}"]')
    expect(row.locator(".configuration")).to_contain_text("0.25 fGPU · 2 cores · 8 GiB")

    # The other preset, adjusted: its GPU request goes with the change, the rest stays the preset's.
    page.click("#start-session")
    expect(dialog).to_be_visible()
    page.locator(f"#preset-{memory['id']}").check()
    expect(page.locator("#tab-memory")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#gpu-memory")).to_have_value("2G")
    expect(page.locator("#gpu-cores")).to_have_value("25")
    expect(page.locator("#mem-size")).to_have_value("2G")
    with page.expect_request(lambda r: r.url.endswith("/preview/") and (r.post_data_json or {}).get(
            "resources", {}).get("gpu_cores") == 50) as preview_request:
        page.fill("#gpu-cores", "50")
    assert preview_request.value.post_data_json["preset"] == memory["id"]
    expect(page.locator("#preview-devices tbody tr").first).to_contain_text("40\u00a0SMs")
    second = launched(page)
    assert second["body"] == {"name": "session-2", "preset": memory["id"],
                              "resources": {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 50}}
    assert second["session"]["resources"] == {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 50, "cpu": 1, "mem": 2 * GiB}

    # A phone: the picker stacks its cards and stays first.
    page.set_viewport_size({"width": 390, "height": 844})
    page.click("#start-session")
    expect(dialog).to_be_visible()
    page.locator(f"#preset-{small['id']}").check()
    expect(page.locator("#preview-config")).to_have_text("0.25 fGPU · 2 cores · 8 GiB")
    width = page.evaluate("document.querySelector('#preset-options').scrollWidth <= "
                          "document.querySelector('#preset-options').clientWidth")
    assert width, "the preset cards overflow the dialog at 390 px"
    page.locator("#launch-dialog .dialog-body").evaluate("body => { body.scrollTop = 0; }")
    page.screenshot(path=str(screenshot_dir() / "launch-preset-phone.png"), animations="disabled")
    assert page.js_errors == []


def test_the_admin_defines_a_preset_in_gib_and_sees_an_impossible_one_refused(console_url, page):
    from playwright.sync_api import expect

    missing = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    log_in_and_open_the_dialog(page, console_url)
    page.goto(console_url + "/admin/compute_sessions/resourcepreset/add/")
    page.fill("#id_name", "Too big")
    page.fill("#id_resources", '{"cuda.shares": "3"}')
    page.fill("#id_cpu", "2")
    page.fill("#id_mem", "8 GiB")
    page.click("input[name=_save]")
    expect(page.locator(".field-resources .errorlist")).to_contain_text("2.00 fGPU")  # demo-node's GPU holds 2
    expect(page.locator(".field-configuration .readonly")).to_have_text("—")  # nothing saved, nothing to show
    page.screenshot(path=str(screenshot_dir() / "admin-preset-refused.png"), full_page=True, animations="disabled")

    page.fill("#id_name", "Small notebook")
    page.fill("#id_resources", '{"cuda.shares": "0.25"}')
    page.click("input[name=_save]")
    row = page.locator("#result_list tbody tr").first
    expect(row).to_contain_text("Small notebook")
    expect(row).to_contain_text("0.25 fGPU · 2 cores · 8 GiB")
    expect(row).to_contain_text("any (everyone)")
    expect(row.locator(".field-image_reference")).to_have_text("the default")
    page.screenshot(path=str(screenshot_dir() / "admin-preset-list.png"), full_page=True, animations="disabled")
    row.locator("th a").click()
    expect(page.locator("#id_mem")).to_have_value("8 GiB")
    assert missing == []
    # The admin's pages link no icon: Chromium's own /favicon.ico request is a 404 (not a page's).
    assert [e for e in page.js_errors if "404 (Not Found)" not in e] == []


def test_a_preset_tried_from_another_tab_leaves_the_users_own_request_as_they_set_it(console_url, page):
    """Issue 36.6: the user sets Memory + cores, visits Fraction, tries a preset and leaves it
    (Custom, or another style's tab): the dialog shows and sends what the user set, never a mix
    of theirs and the preset's. Fails on the old dialog, which kept the preset picked (sending
    it with the user's GPU fields as changes) and left its values in the user's tabs."""
    from playwright.sync_api import expect

    token = api_post(console_url, "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})["token"]
    small = api_post(console_url, "/api/v1/presets/", {
        "name": "Small notebook", "resources": {"cuda.shares": "0.25"}, "cpu": 2, "mem": "8G"}, token)
    memory = api_post(console_url, "/api/v1/presets/", {
        "name": "Memory slice", "resources": {"gpu": 1, "gpu_memory_percentage": 50}, "mem": "2G"}, token)
    dialog = log_in_and_open_the_dialog(page, console_url)

    page.click("#tab-memory")
    page.fill("#gpu-memory", "3G")
    page.fill("#gpu-cores", "40")
    page.click("#tab-fraction")
    page.fill("#gpu-fraction", "0.3")

    # A Memory + cores preset picked from Fraction fills Memory + cores; Custom gives back the user's own.
    page.locator(f"#preset-{memory['id']}").check()
    expect(page.locator("#tab-memory")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#gpu-memory-by-percent")).to_be_checked()
    expect(page.locator("#gpu-cores")).to_have_value("")
    page.locator("#preset-custom").check()
    expect(page.locator("#tab-fraction")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#gpu-fraction")).to_have_value("0.3")
    expect(page.locator("#mem-size")).to_have_value("1G")
    page.click("#tab-memory")
    expect(page.locator("#gpu-memory-by-size")).to_be_checked()
    expect(page.locator("#gpu-memory")).to_have_value("3G")
    expect(page.locator("#gpu-cores")).to_have_value("40")

    # An fGPU preset picked from Fraction, then back to Memory + cores: the preset is left for
    # Custom (its CPU and memory stay in the fields, and go as they stand), nothing else of it.
    page.click("#tab-fraction")
    page.locator(f"#preset-{small['id']}").check()
    expect(page.locator("#tab-fgpu")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#cpu-count")).to_have_value("2")
    page.click("#tab-memory")
    expect(page.locator("#preset-custom")).to_be_checked()
    expect(page.locator("#preset-hint")).to_have_text("Custom: the request below as it stands, started from Small notebook.")
    expect(page.locator("#gpu-memory")).to_have_value("3G")
    expect(page.locator("#gpu-cores")).to_have_value("40")
    expect(page.locator("#preview-config")).to_contain_text("3 GiB")
    expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
    dialog.screenshot(path=str(screenshot_dir() / "launch-preset-left.png"), animations="disabled")
    sent = launched(page)
    assert sent["body"] == {"name": "session-1", "image": "host",
                            "resources": {"gpu": 1, "gpu_memory": "3G", "gpu_cores": 40, "cpu": 2, "mem": "8G"}}
    assert sent["session"]["resources"] == {"gpu": 1, "gpu_memory": "3G", "gpu_cores": 40, "cpu": 2, "mem": "8G"}
    assert page.js_errors == []
