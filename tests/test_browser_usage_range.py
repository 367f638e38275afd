"""The usage charts' range picker and hover legends in a real browser (issue 15, pictures),
against the standalone console (tests/test_browser_workloads.py's `console`): a session with ten
days of 5-minute rollups (written into the console's database, summed into hours and days by
usage_rollup as beat does) is charted over the last hour, day, week and month at the resolution
the server picks; hovering a chart names the time and each series' value under the cursor; the
node admin page has the same picker. Desktop screenshots."""
from __future__ import annotations

import re

import pytest

from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)
from tests.test_browser_workloads import browser, console, log_in, new_page, wait_status  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser

HISTORY = """
import time
from sessions.models import ComputeSession
from usage.models import RollupState, SessionRollup
from usage.services import usage_rollup
session = ComputeSession.objects.get(pk='{id}')
now = int(time.time())
mark = (now - 3600) // 300 * 300
SessionRollup.objects.bulk_create([
    SessionRollup(session=session, bucket=b, samples=60, span_s=300, gpu_span_s=300,
                  gpu_memory_s=(256 + (b // 300) % 64 * 16) * (1 << 20) * 300, gpu_memory_max=1 << 30,
                  gpu_util_s=(b // 300) % 100 * 300, gpu_util_max=99, cpu_s=500 * 300, mem_max=1 << 28)
    for b in range(mark - 10 * 86400, mark, 300)], ignore_conflicts=True)
RollupState.objects.update_or_create(pk=1, defaults={{"watermark": mark, "hour_watermark": 0, "day_watermark": 0}})
usage_rollup(now=now)
"""


def hover_legend(page, chart):
    """Move the mouse over the middle of `chart`'s plot; its legend's cells (time, then series)."""
    box = chart.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)
    return chart.locator(".u-legend .u-series .u-value")


def test_the_range_picker_redraws_the_charts_at_the_servers_resolution_and_hovering_names_the_values(console, browser):
    from playwright.sync_api import expect

    admin = console.api("admin", ADMIN_PASSWORD)
    session = admin.call("POST", "/api/v1/sessions/", {"name": "history", "resources": {"cuda.shares": "0.5",
                                                                                         "mem": "64M"}})[1]
    session = wait_status(admin, session["id"], "RUNNING")
    console.manage(HISTORY.format(id=session["id"]))

    page = new_page(browser)
    log_in(page, console.url)
    page.goto(console.url + session["terminal_url"])
    charts, panel = page.locator("#usage-charts"), page.locator("#usage-panel")
    picker = page.locator(".usage-range")
    expect(picker.locator("button")).to_have_text(["Hour", "Day", "Week", "Month"])
    expect(picker.locator('[aria-pressed="true"]')).to_have_text("Hour")
    expect(charts).to_have_attribute("data-state", "live")
    expect(panel.locator(".usage-resolution")).to_have_text("every sample")

    memory = charts.locator('[data-chart="memory"]')
    for label, words, resolution, points in (("Month", "last 30 days", "hourly means", r"^2[4-9]\d$"),
                                             ("Week", "last week", "hourly means", r"^1[67]\d$"),
                                             ("Day", "last day", "5-minute means", r"^2[6-9]\d$")):
        picker.get_by_role("button", name=label).click()
        expect(picker.locator('[aria-pressed="true"]')).to_have_text(label)
        expect(panel.locator(".usage-range-label")).to_have_text(words)
        expect(panel.locator(".usage-resolution")).to_have_text(resolution)
        expect(memory).to_have_attribute("data-points", re.compile(points))
        expect(memory.locator(".usage-chart-empty")).to_be_hidden()

    # Hover: the legend names the time and the value of each series under the cursor.
    cells = hover_legend(page, memory)
    expect(cells.nth(0)).to_have_text(re.compile(r"\d{2}:\d{2}:\d{2}"))
    expect(cells.nth(1)).to_have_text(re.compile(r"^\d+(\.\d+)? [MG]iB$"))  # used: 256-1264 MiB (1 GiB and more in GiB)
    expect(cells.nth(2)).to_have_text("2 GiB")  # the limit
    util = charts.locator('[data-chart="util"]')
    expect(hover_legend(page, util).nth(1)).to_have_text(re.compile(r"^\d+ %$"))
    page.screenshot(path=str(screenshot_dir() / "usage-range-day-hover.png"))
    picker.get_by_role("button", name="Month").click()
    expect(memory).to_have_attribute("data-points", re.compile(r"^2[4-9]\d$"))
    hover_legend(page, memory)
    expect(memory.locator(".u-legend .u-series .u-value").nth(0)).to_have_text(re.compile(r"[A-Za-z]{3}"))  # with its date
    page.screenshot(path=str(screenshot_dir() / "usage-range-month-hover.png"))
    assert not page.js_errors, page.js_errors

    # The node admin page: the same picker above its GPUs' charts.
    page.goto(console.url + "/admin/accelerators/node/")
    page.get_by_role("link", name="demo-node", exact=True).click()
    node_picker = page.locator(".usage-range")
    expect(node_picker.locator('[aria-pressed="true"]')).to_have_text("Hour")
    device = page.locator("#node-usage-charts .usage-device").first
    expect(device.locator('[data-chart="memory"]')).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
    node_picker.get_by_role("button", name="Week").click()
    expect(page.locator("#node-usage-charts")).to_have_attribute("data-range", "week")
    expect(device.locator('[data-chart="memory"]')).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
    device.scroll_into_view_if_needed()
    expect(hover_legend(page, device.locator('[data-chart="memory"]')).nth(1)).to_have_text(re.compile(r"B$"))
    page.screenshot(path=str(screenshot_dir() / "usage-range-node-week.png"))
    assert not [e for e in page.js_errors if "Failed to load resource" not in e], page.js_errors
