"""Usage end to end on the distributed stack (issue 15, "How it is checked"): a batch session on a
mock node that declares growing GPU memory in a loop (the mock device reports what a program
writes to `$HOME/.fgpu-usage`, agent/usage.py) shows it growing in its samples, in the session
usage API and in /metrics, while a second session's stays flat; and in a browser the session
page's charts draw those samples, the list's gauge shows memory used of granted (screenshots).

The agents sample every second and send every two (agent.toml `[usage]`), so a step of the loop
reaches the manager within seconds; every wait is on a condition with a deadline."""
from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import GiB, ROOT, StackNode, wait_until
from tests.test_cli_e2e import FGPU
from tests.test_browser import page, screenshot_dir  # noqa: F401 (fixture)
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 13  # of its own, flushed first (7 and 11 are the other e2e tests')
METRICS_TOKEN = "usage-e2e-metrics-token"
MiB = 1 << 20
STEPS_MIB = (256, 512, 768, 1024, 1280)
FLAT_MIB = 300
STORAGE_LIMIT_MIB = 48
GROWS = ("for m in " + " ".join(map(str, STEPS_MIB)) + "; do "
         "printf '{\"memory\": \"%sM\", \"util\": 60}' $m > $HOME/.fgpu-usage.tmp && mv $HOME/.fgpu-usage.tmp $HOME/.fgpu-usage; "
         "sleep 4; done; sleep 600")
FLAT = (f"printf '{{\"memory\": \"{FLAT_MIB}M\", \"util\": 20}}' > $HOME/.fgpu-usage.tmp && "
        "mv $HOME/.fgpu-usage.tmp $HOME/.fgpu-usage; sleep 600")


@dataclass
class FastSamplingNode(StackNode):
    """A stack node whose agent samples every second and sends every two, and measures its sessions'
    storage every 5 s (the least agent.toml allows) against a session limit of STORAGE_LIMIT_MIB."""

    def agent_toml(self) -> str:
        return (super().agent_toml() + "\n[usage]\ninterval = 1\nflush = 2\n"
                f'[limits]\nstorage-interval = 5\nsession-storage = "{STORAGE_LIMIT_MIB}M"\n')


@pytest.fixture
def usage_stack(distributed_stack, django_user_model, monkeypatch):
    """The stack with the demo node (one 8 GiB GPU, 2 fGPU), /metrics on, user alice, and two
    RUNNING batch sessions of hers (and an administrator, root): `grows` (0.5 fGPU, declaring 256 → 1280 MiB, a step every 4 s)
    and `flat` (0.25 fGPU, 300 MiB throughout). Returns (base, token, grows id, flat id)."""
    monkeypatch.setenv("FGPU_METRICS_TOKEN", METRICS_TOKEN)  # the web process reads it
    stack = distributed_stack(nodes=[FastSamplingNode("usage-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    django_user_model.objects.create_superuser("root", password="root-pass-123")  # for the node admin page
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    base, token = stack.base, body["token"]
    ids = []
    for name, shares, command in (("grows", "0.5", GROWS), ("flat", "0.25", FLAT)):
        status, created = api(base, "POST", "/api/v1/sessions/", token,
                              {"name": name, "resources": {"cuda.shares": shares, "cpu": 1, "mem": "256M"}, "command": command})
        assert status == 201, created
        ids.append(created["id"])
    for session_id in ids:
        wait_until(lambda: get_ok(base, f"/api/v1/sessions/{session_id}/", token)["status"] == "RUNNING", timeout=60,
                   what="the session to be RUNNING")
    return base, token, ids[0], ids[1]


def memory_series(base: str, token: str, session_id: str) -> list[int]:
    """The session's known GPU memory samples (bytes), oldest first."""
    return [m for m in get_ok(base, f"/api/v1/sessions/{session_id}/usage/", token)["gpu_memory"] if m is not None]


def metrics_memory(base: str) -> dict[str, float]:
    """{session id: vGPU_device_memory_usage_in_bytes} from one scrape of /metrics."""
    request = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {s.labels["session"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "vGPU_device_memory_usage_in_bytes"}


def run_in(base: str, token: str, session_id: str, command: str) -> None:
    """Run a shell line in the session (POST …/exec/), as its user would in its terminal."""
    status, body = api(base, "POST", f"/api/v1/sessions/{session_id}/exec/", token, {"command": command, "timeout": 30})
    assert status == 200 and body["exit_code"] == 0, body


def storage_measured(base: str, token: str, session_id: str, at_least: int) -> dict | None:
    """The session's usage answer once its storage figure reached `at_least` bytes, else None."""
    answer = get_ok(base, f"/api/v1/sessions/{session_id}/usage/", token)
    return answer if (answer["storage"] or 0) >= at_least else None


def after_first(values: list, value) -> list:
    """`values` from the first that equals `value` on (what came before it was the session starting)."""
    return values[values.index(value):] if value in values else []


def test_a_session_declaring_growing_memory_grows_in_its_samples_and_metrics_while_another_stays_flat(usage_stack):
    base, token, grows, flat = usage_stack
    scraped: dict[str, list[float]] = {grows: [], flat: []}

    def scrape_until_the_last_step():
        for session_id, value in metrics_memory(base).items():
            if session_id in scraped and (not scraped[session_id] or scraped[session_id][-1] != value):
                scraped[session_id].append(value)  # each change, in the order seen
        return scraped[grows] and scraped[grows][-1] == STEPS_MIB[-1] * MiB

    wait_until(scrape_until_the_last_step, timeout=90, interval=0.5, what="/metrics to show the last step")

    # /metrics: the growing session went up step by step, never down; the flat one never moved.
    growth = after_first(scraped[grows], STEPS_MIB[0] * MiB) or scraped[grows]
    assert growth == sorted(growth) and len(set(growth)) >= 3, scraped[grows]
    assert set(v / MiB for v in growth) <= {0, *STEPS_MIB}, scraped[grows]
    assert after_first(scraped[flat], FLAT_MIB * MiB) == [FLAT_MIB * MiB], scraped[flat]

    # The session usage API: every step in order, each held for a few samples, none invented.
    samples = memory_series(base, token, grows)
    steps = [m for i, m in enumerate(samples) if i == 0 or samples[i - 1] != m]
    assert steps[-len(STEPS_MIB):] == [s * MiB for s in STEPS_MIB], steps
    assert samples == sorted(samples)
    still = after_first(memory_series(base, token, flat), FLAT_MIB * MiB)
    assert len(still) >= 10 and set(still) == {FLAT_MIB * MiB}, still

    # The list's gauges read the newest sample and the granted memory (0.5 fGPU = 2 GiB, 0.25 = 1 GiB).
    params = f"session={grows}&session={flat}"
    now = {r["id"]: r for r in get_ok(base, f"/api/v1/usage/latest/?{params}", token)["sessions"]}
    assert (now[grows]["gpu_memory"], now[grows]["gpu_memory_limit"]) == (STEPS_MIB[-1] * MiB, 2048 * MiB)
    assert (now[flat]["gpu_memory"], now[flat]["gpu_memory_limit"]) == (FLAT_MIB * MiB, 1024 * MiB)

    # The node's GPU: the sum of both declarations.
    (gpu,) = get_ok(base, "/api/v1/nodes/usage-node/usage/", token)["devices"]
    assert gpu["memory_used"][-1] == (STEPS_MIB[-1] + FLAT_MIB) * MiB


def test_a_sessions_storage_reaches_the_api_my_resources_and_fgpu_describe_and_past_its_limit_it_stops_saying_so(
        usage_stack, tmp_path):
    base, token, grows, flat = usage_stack
    run_in(base, token, grows, "head -c 8388608 /dev/zero > home.bin && head -c 3145728 /dev/zero > data/mine.bin")

    # The agent's measure, in its next sample, through the broker to the manager, in the API.
    answer = wait_until(lambda: storage_measured(base, token, grows, 8 * MiB), timeout=60, interval=0.5,
                        what="the session's 8 MiB to show in its usage")
    assert 8 * MiB <= answer["storage"] < 9 * MiB, answer  # its home; ~/data is the user's own figure
    assert answer["storage_limit"] == STORAGE_LIMIT_MIB * MiB and answer["storage_t"] is not None
    folders = wait_until(lambda: [f for f in get_ok(base, "/api/v1/my-resources/", token)["storage"] if f["used"] >= 3 * MiB],
                         timeout=30, interval=0.5, what="~/data's 3 MiB in My resources")
    assert [(f["folder"], f["node"], f["limit"]) for f in folders] == [("~/data", "usage-node", 10 * GiB)], folders

    env = {k: v for k, v in os.environ.items() if k not in ("FGPU_URL", "FGPU_TOKEN")}
    described = subprocess.run([FGPU, "describe", grows], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                               env={**env, "XDG_CONFIG_HOME": str(tmp_path), "FGPU_URL": base, "FGPU_TOKEN": token})
    assert described.returncode == 0, described.stderr
    assert re.search(r"^Storage: +8(\.\d+)? MiB of 48 MiB \(1[67] %\)$", described.stdout, re.M), described.stdout

    # Past its limit the agent stops it, and the session says why.
    run_in(base, token, flat, "head -c 62914560 /dev/zero > big.bin")
    ended = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{flat}/", token))["status"] not in ("RUNNING", "TERMINATING")
                       and s, timeout=60, interval=0.5, what="the session past its storage limit to stop")
    assert ended["status"] == "TERMINATED", ended
    assert re.fullmatch(r"used 60(\.\d)? MiB of its 48 MiB storage limit \(home\)", ended["status_reason"]), ended
    assert get_ok(base, f"/api/v1/sessions/{grows}/", token)["status"] == "RUNNING"  # the other stays


@pytest.mark.browser
def test_the_session_page_charts_its_samples_and_the_list_gauges_memory_used_of_granted(usage_stack, page):
    from playwright.sync_api import expect

    base, token, grows, flat = usage_stack
    wait_until(lambda: max(memory_series(base, token, grows), default=0) >= STEPS_MIB[2] * MiB, timeout=60, interval=0.5,
               what="the growing session's samples to reach its third step")
    run_in(base, token, grows, "head -c 12582912 /dev/zero > home.bin && head -c 3145728 /dev/zero > data/mine.bin")
    wait_until(lambda: storage_measured(base, token, grows, 12 * MiB), timeout=60, interval=0.5,
               what="the session's storage to be measured")
    wait_until(lambda: [f for f in get_ok(base, "/api/v1/my-resources/", token)["storage"] if f["used"] >= 3 * MiB],
               timeout=30, interval=0.5, what="~/data's use to be measured")
    page.goto(base + "/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-pass-123")
    page.click("#login-submit")
    expect(page).to_have_url(base + "/sessions/")

    # The list: each running session's gauge, memory used of granted, filled from the samples.
    gauge = page.locator(f'.usage-gauge[data-session-id="{flat}"]')
    expect(gauge.locator(".usage-gauge-text")).to_have_text("300 MiB / 1 GiB")
    expect(page.locator(f'.usage-gauge[data-session-id="{grows}"]')).to_have_attribute("data-state", re.compile("ok|high"))
    width = gauge.locator(".usage-gauge-fill").evaluate("e => e.style.width")
    assert width == "29.3%", width  # 300 MiB of 1024
    page.screenshot(path=str(screenshot_dir() / "usage-list-gauges.png"))
    # My resources: the user's data folder on the node, against its limit.
    folder = page.locator('#resources-storage li[data-folder="~/data"][data-node="usage-node"]')
    expect(folder.locator(".resources-label")).to_have_text("~/data on usage-node")
    expect(folder.locator(".resources-value")).to_have_text(re.compile(r"^3(\.\d)? MiB of 10 GiB$"))
    expect(folder.locator("[role=meter]")).to_have_attribute("aria-valuetext", re.compile(r"of 10 GiB$"))
    page.locator("#my-resources").screenshot(path=str(screenshot_dir() / "usage-my-resources-storage.png"))

    # The session page: three charts with points, none showing "no samples", a canvas each.
    page.goto(base + f"/sessions/{grows}/terminal/")
    charts = page.locator("#usage-charts .usage-chart")
    expect(charts).to_have_count(3)
    for key in ("memory", "util", "cpu"):
        chart = page.locator(f'#usage-charts [data-chart="{key}"]')
        expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
        expect(chart.locator(".usage-chart-empty")).to_be_hidden()
        expect(chart.locator("canvas")).to_have_count(1)
    expect(page.locator("#usage-panel .usage-limit")).to_have_text("2 GiB")
    expect(page.locator("#usage-panel .usage-stale")).to_be_hidden()
    # The memory chart drew something: its canvas has non-background pixels in the plot area.
    painted = page.locator('#usage-charts [data-chart="memory"] canvas').evaluate("""c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
    assert painted > 500, painted
    expect(page.locator('#usage-charts [data-chart="memory"] .usage-chart-now')).to_have_text(re.compile(r"^[\d.]+ [MG]iB$"))
    # Its storage against the limit its node enforces: "12.01 MiB of 48 MiB" and a meter a quarter full.
    storage = page.locator("#usage-storage")
    expect(storage.locator(".usage-storage-text")).to_have_text(re.compile(r"^12(\.\d+)? MiB of 48 MiB$"))
    expect(storage.locator("[role=meter]")).to_have_attribute("aria-valuenow", re.compile(r"^2[56]$"))
    storage.screenshot(path=str(screenshot_dir() / "usage-session-storage.png"))
    page.screenshot(path=str(screenshot_dir() / "usage-session-page.png"))

    assert not page.js_errors, page.js_errors

    # The node admin page: its GPU's memory and utilisation charted (an administrator signs in).
    failed = []
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)
    page.goto(base + "/admin/login/?next=/admin/accelerators/node/")
    page.fill("#id_username", "root")
    page.fill("#id_password", "root-pass-123")
    page.locator("input[type=submit]").click()
    page.get_by_role("link", name="usage-node", exact=True).click()
    device = page.locator("#node-usage-charts .usage-device")
    expect(device).to_have_count(1)
    for key in ("memory", "util"):
        expect(device.locator(f'[data-chart="{key}"]')).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
        expect(device.locator(f'[data-chart="{key}"] .usage-chart-empty')).to_be_hidden()
    device.scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot_dir() / "usage-node-admin.png"))
    # The admin has no favicon link, so the browser's /favicon.ico 404 is logged; nothing else may fail.
    assert not failed, failed
    assert not [e for e in page.js_errors if not e.startswith("console.error: Failed to load resource")], page.js_errors
