"""The admin in a real browser (issue 18.5), against the console as `make run` starts it with the
demo's MIG node (`FGPU_AGENT_CONFIG=demo/agent.toml,demo/agent-mig-h100.toml`):

- the fixed MIG layout is edited in rows (profile and start, the starts each profile allows),
  checked live by the server as saving will check it — an overlap is named before Save, and
  drawn — and saved as the JSON the form always took, beside the slice picture;
- a configuration file is uploaded: a broken TOML is refused with its file, field and problem
  and imports nothing; the demo's etcd JSON imports, with the importer's summary.

Screenshots (in $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/): admin-mig-layout-editor.png,
admin-mig-layout-overlap.png, admin-mig-layout-dark.png, admin-import-error.png,
admin-import-done.png, admin-session.png."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT
from tests.test_browser import TIMEOUT_MS, console_url, page, screenshot_dir  # noqa: F401  (fixtures)
from tests.test_browser_contrast import api, log_in
from tests.test_browser_mig import mig_console_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

OK = "✓ This layout can be created on the GPUs."


def test_an_administrator_edits_the_fixed_mig_layout_in_rows_checked_live_and_imports_a_configuration(
        mig_console_url, page, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    base, shots = mig_console_url, screenshot_dir()
    log_in(page, base)

    page.goto(base + "/admin/accelerators/node/")
    expect(page.locator("#site-name")).to_have_text("fGPU Console administration")
    page.get_by_role("link", name="demo-mig-node", exact=True).click()
    # In dynamic mode the agent makes the instances: no layout editor shows (nor in static or off
    # mode); choosing "fixed" brings it, choosing another mode hides it again.
    page.select_option("#id_mig_mode", "dynamic")
    expect(page.locator(".field-mig_layout")).to_be_hidden()
    expect(page.locator(".field-mig_picture")).to_be_visible()
    page.select_option("#id_mig_mode", "fixed")
    expect(page.locator(".field-mig_layout")).to_be_visible()
    page.select_option("#id_mig_mode", "static")
    expect(page.locator(".field-mig_layout")).to_be_hidden()
    page.select_option("#id_mig_mode", "fixed")
    editor = page.locator(".mig-layout-editor")
    rows = editor.locator("tbody tr")
    status = editor.locator(".mig-layout-status")
    expect(rows).to_have_count(0)
    expect(editor.locator(".mig-layout-empty")).to_be_visible()

    # A first instance: the smallest profile at the first free slice, then made a 3g.40gb.
    editor.get_by_role("button", name="Add an instance").click()
    expect(rows).to_have_count(1)
    expect(status).to_have_text(OK)
    rows.nth(0).locator(".mig-profile-select").select_option("3g.40gb")
    # Only the starts the catalog allows for 3g.40gb are offered.
    expect(rows.nth(0).locator(".mig-start option")).to_have_text(["0", "4"])
    expect(rows.nth(0).locator(".mig-span")).to_have_text("0–3")

    # A second one goes to the first free slice; made a 3g.40gb too, it fills the GPU.
    editor.get_by_role("button", name="Add an instance").click()
    expect(rows.nth(1).locator(".mig-start")).to_have_value("4")
    rows.nth(1).locator(".mig-profile-select").select_option("3g.40gb")
    expect(status).to_have_text(OK)
    preview = editor.locator(".mig-layout-preview td.mig-cell")
    expect(preview).to_have_text(["3g.40gb"] * 8)
    page.locator(".field-mig_layout").screenshot(path=str(shots / "admin-mig-layout-editor.png"), animations="disabled")

    # Moved onto the first, the server names the overlap before anything is saved; the picture shows it.
    rows.nth(1).locator(".mig-start").select_option("0")
    expect(status).to_contain_text("memory slice 0 is already held by 3g.40gb@0")
    expect(editor.locator(".mig-layout-preview td.mig-overlap")).to_have_count(4)
    page.locator(".field-mig_layout").screenshot(path=str(shots / "admin-mig-layout-overlap.png"),
                                                 animations="disabled")
    rows.nth(1).locator(".mig-start").select_option("4")
    expect(status).to_have_text(OK)

    # Saved as the JSON the form takes; the node's picture now shows the two idle instances.
    assert page.locator("#id_mig_layout").input_value() == \
        '{"0":[{"profile":"3g.40gb","start":0},{"profile":"3g.40gb","start":4}]}'
    page.click("input[name=_continue]")
    expect(page.locator(".messagelist")).to_contain_text("MIG layout of demo-mig-node")
    layout = page.request.get(base + "/api/v1/nodes/demo-mig-node/mig/").json()
    assert (layout["mig_mode"], layout["mig_layout"]) == (
        "fixed", {"0": [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]})
    picture = page.locator(".field-mig_picture table.mig-slices tr").first.locator("td")
    expect(picture).to_have_text(["3g.40gb"] * 8)
    expect(rows).to_have_count(2)  # the editor reads the saved layout back
    expect(status).to_have_text(OK)
    page.emulate_media(color_scheme="dark")
    page.locator("fieldset", has=page.locator("#id_mig_mode")).screenshot(
        path=str(shots / "admin-mig-layout-dark.png"), animations="disabled")
    page.emulate_media(color_scheme="light")

    # Removing both leaves an empty layout: every slice free.
    rows.nth(0).get_by_role("button", name="Remove instance 1").click()
    rows.nth(0).get_by_role("button", name="Remove instance 1").click()
    expect(rows).to_have_count(0)
    expect(preview).to_have_text(["free"] * 8)
    assert page.locator("#id_mig_layout").input_value() == "{}"

    # A configuration file: a broken one is refused whole, naming the field; the etcd JSON imports.
    broken = tmp_path / "broken.toml"
    broken.write_text((ROOT / "demo" / "mock-accelerator.toml").read_text().replace('memory_size = "8G"',
                                                                                     'memory_size = "1.1"'))
    page.goto(base + "/admin/accelerators/slotformat/")
    before = page.locator("#result_list tbody tr").count()
    page.get_by_role("link", name="Import a configuration file").click()
    page.set_input_files("#id_file", str(broken))
    page.fill("#id_node", "imported-node")
    page.click("#config-import-submit")
    expect(page.locator("#import-error")).to_contain_text(
        "Nothing was imported. broken.toml: devices[0].memory_size: '1.1': a fractional size needs a unit suffix")
    page.screenshot(path=str(shots / "admin-import-error.png"), full_page=True, animations="disabled")
    assert page.request.get(base + "/api/v1/nodes/imported-node/").status == 404

    page.set_input_files("#id_file", str(ROOT / "demo" / "accelerator.json"))
    page.click("#config-import-submit")
    expect(page.locator("#import-report")).to_contain_text("Imported.")
    expect(page.locator("#import-summary")).to_contain_text(
        re.compile(r"Imported accelerator\.json \(etcd JSON; slot cuda\)\.\s+fractional settings: 0 created, 0 updated, "
                   r"1 unchanged \(cuda\)"))
    page.screenshot(path=str(shots / "admin-import-done.png"), full_page=True, animations="disabled")
    page.goto(base + "/admin/accelerators/slotformat/")
    expect(page.locator("#result_list tbody tr")).to_have_count(before)

    # A session's page in the field's words.
    created = api(page, base, "POST", "/api/v1/sessions/",
                  {"name": "admin-view", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}}).json()
    page.goto(base + f"/admin/compute_sessions/computesession/{created['id']}/change/")
    expect(page.locator(".field-host_memory .readonly span.size")).to_have_attribute("title", "1,073,741,824 bytes")
    expect(page.locator(".field-created time")).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$"))
    page.screenshot(path=str(shots / "admin-session.png"), full_page=True, animations="disabled")
