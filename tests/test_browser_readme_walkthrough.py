"""README's walkthrough, step by step, in a real browser (issue 36.1): the console as `make run`
starts it (standalone, the demo node on the process runtime) on a free port that is not 8000, the
addresses taken from README with `$PORT` filled in, and each step's screen checked against what
README says it shows (the words are read from README's "The walkthrough" section, so README and
screen cannot drift apart unnoticed):

1. the address → the sign-in page → the session list;
2. Start a session, 0.50 fGPU, Launch: the row's configuration, and every status the row showed
   on its way to RUNNING (recorded in the page: a state drawn for a few milliseconds counts) is
   one README's status line names, in its order;
3. the terminal: `nvidia-smi` prints the 2048MiB slice;
4. JupyterLab beside Terminal (its link; tests/test_browser_jupyter.py opens it);
5. admin → Accelerators → Nodes → demo-node: "Processes on its GPUs" lists the session's process;
6. admin → Compute sessions → Fragmentation maps: the demo's resource group "default";
7. Terminate from the terminal page: "Session ended: terminated by you".

and its "MIG, and whole GPUs" paragraph: started as `make run DEMO=full` starts it (`--demo=full`,
read from the Makefile), the launch dialog's MIG tab lists demo-mig-node's profiles at once (no
visit to the admin), a MIG session starts on it, and both nodes are in the group "default".

Screenshots (readme-walkthrough-*.png) go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.conftest import ROOT, free_port, wait_until
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, answers, screenshot_dir, terminal_lines
from tests.test_browser import page  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

STATES = ("PENDING", "SCHEDULED", "PREPARING", "RUNNING")


def walkthrough() -> str:
    """README's "The walkthrough" section, up to the next heading of its level, each line break
    (with the next line's indent) read as one space; spaces within a line are kept."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## The walkthrough\n")
    end = text.index("\n## ", start + 1)
    return re.sub(r" *\n *", " ", text[start:end])


def readme_url(section: str, port: int) -> str:
    """The first console address in `section`, with `$PORT` filled in; it must not name a port."""
    found = re.search(r"http://(?:127\.0\.0\.1|localhost):(\S+?)/", section)
    assert found, "README's walkthrough names no console address"
    assert found.group(1) == "$PORT", f"README's walkthrough names port {found.group(1)}, not $PORT"
    return found.group(0).replace("$PORT", str(port))


def demo_argv(demo: str) -> list[str]:
    """What `make run DEMO=<demo>` adds to `manage.py standalone` (read from the Makefile)."""
    if not demo:
        return []
    assert "manage.py standalone$(if $(DEMO), --demo=$(DEMO))" in (ROOT / "Makefile").read_text()
    return [f"--demo={demo}"]


def start_console(procs, tmp_path, demo: str = "") -> int:
    """`manage.py standalone` as `make run [DEMO=demo]` starts it, on a free port other than 8000
    (the process runtime: the walkthrough's host view lists a process of this machine)."""
    port = free_port()
    while port in (8000, 8001):
        port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(FGPU_DATA_DIR=str(tmp_path / "data"), FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD, PORT=str(port),
               PYTHONUNBUFFERED="1", FGPU_RUNTIME="process")
    env.pop("FGPU_AGENT_CONFIG", None)
    server = procs.start("standalone", [sys.executable, "manage.py", "standalone", *demo_argv(demo)], env)

    def ready():
        assert server.popen.poll() is None, f"standalone exited:\n{server.output()}"
        return "fGPU Console is serving on" in server.output() and answers(f"http://127.0.0.1:{port}/login/")

    wait_until(ready, timeout=90, interval=0.2, what="the standalone console to serve /login/")
    return port


@pytest.fixture
def readme_console(procs, tmp_path):
    return start_console(procs, tmp_path)


# The row's status badge, each text it takes, recorded in the page (a MutationObserver), so that a
# state that lasts a few milliseconds is seen too.
RECORD_STATUSES = """(id) => {
  window.seenStatuses = [];
  const note = () => {
    const badge = document.querySelector(`#sessions-table tr[data-session-id="${id}"] td.status .badge`);
    const text = badge && badge.textContent.trim();
    const last = window.seenStatuses[window.seenStatuses.length - 1];
    if (text && (!last || last[0] !== text)) window.seenStatuses.push([text, Math.round(performance.now())]);
  };
  note();
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def test_the_readme_walkthrough_on_a_port_other_than_8000(readme_console, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    shots, port, steps = screenshot_dir(), readme_console, walkthrough()
    base = f"http://127.0.0.1:{port}"

    # 1. The address README gives, with $PORT: the sign-in page, then the session list.
    page.goto(readme_url(steps, port))
    expect(page).to_have_url(re.compile(r"/login/"))
    assert "as `admin`" in steps
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(base + "/sessions/")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")

    # 2. Start a session at 0.50 fGPU and launch; record the row's statuses until RUNNING.
    assert "**Start a session**" in steps and "**0.50 fGPU**" in steps
    page.click("#start-session")
    slider, readout = page.locator("#fgpu-slider"), page.locator("#fgpu-readout")
    expect(slider).to_be_enabled()
    slider.focus()
    page.keyboard.press("Home")
    page.keyboard.press("ArrowRight")
    expect(readout).to_have_text("0.50 fGPU")
    page.locator("#launch-dialog").screenshot(path=str(shots / "readme-walkthrough-launch.png"), animations="disabled")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    created = info.value.json()
    assert info.value.status == 201, created
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row).to_be_visible()
    page.evaluate(RECORD_STATUSES, created["id"])
    configuration = re.search(r"The list shows `([^`]+)`", steps).group(1)
    expect(row.locator("td.configuration")).to_contain_text(configuration)
    expect(row.locator("td.status")).to_have_text("RUNNING")
    timeline = page.evaluate("() => window.seenStatuses")
    print("the row's statuses (text, ms since the page loaded):", timeline)
    seen = [created["status"]] + [text for text, _ in timeline]
    seen = [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s]
    line = re.search(r"the status moves ([A-Z →]+?) live", steps)
    assert line, "README's walkthrough has no status line ('the status moves … live')"
    named = [s.strip() for s in line.group(1).split("→")]
    assert set(named) <= set(STATES) and named[-1] == "RUNNING", named
    assert all(s in named for s in seen), f"the row showed {seen}; README's status line names {named}"
    assert [named.index(s) for s in seen] == sorted(named.index(s) for s in seen), (seen, named)
    page.screenshot(path=str(shots / "readme-walkthrough-list.png"), animations="disabled")

    # 3. The terminal: nvidia-smi shows the slice README names.
    slice_line = re.search(r"the card shows `([^`]+)`", steps).group(1)
    row.locator("a.terminal-link").click()
    expect(page).to_have_url(base + f"/sessions/{created['id']}/terminal/")
    expect(page.locator("#terminal-status")).to_have_text("Connected")

    def prompt():
        lines = [line for line in terminal_lines(page) if line]
        return lines and re.search(r"[$#%>]$", lines[-1]) and lines[-1]

    wait_until(prompt, timeout=30, what="the shell's prompt")
    page.locator("#terminal").click()
    page.keyboard.type("nvidia-smi")
    page.keyboard.press("Enter")
    wait_until(lambda: slice_line in "\n".join(terminal_lines(page)), timeout=30, interval=0.2,
               what=f"nvidia-smi's {slice_line!r}")
    page.screenshot(path=str(shots / "readme-walkthrough-terminal.png"), animations="disabled")

    # 4. JupyterLab beside Terminal (the demo image's app).
    assert "**JupyterLab** beside Terminal" in steps
    page.goto(base + "/sessions/")
    expect(row.locator('a.app-link[data-app="jupyter"]')).to_have_text(re.compile("JupyterLab"))

    # 5. The host's view: admin → Accelerators → Nodes → demo-node, "Processes on its GPUs".
    assert "**Admin** (in the top bar) → **Accelerators** → **Nodes** → `demo-node`" in steps
    page.get_by_role("link", name="Admin", exact=True).click()
    accelerators = page.locator("#content-main .app-accelerators")
    expect(accelerators.locator("caption")).to_contain_text("Accelerators")
    accelerators.get_by_role("link", name="Nodes", exact=True).click()
    page.get_by_role("link", name="demo-node", exact=True).click()
    processes = page.locator("#node-processes")
    expect(page.get_by_text("Processes on its GPUs")).to_be_visible()
    expect(processes).to_contain_text(created["name"], timeout=60_000)
    expect(processes).to_contain_text("2 GiB")
    processes.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "readme-walkthrough-host-view.png"), animations="disabled")

    # 6. The fragmentation map of the demo's resource group "default".
    assert "**Compute sessions** → **Fragmentation maps** → `default`" in steps
    page.goto(base + "/admin/")
    sessions_app = page.locator("#content-main .app-compute_sessions")
    sessions_app.get_by_role("link", name="Fragmentation maps", exact=True).click()
    expect(page.locator("#result_list")).to_contain_text("default")
    page.locator("#result_list").get_by_role("link", name=re.compile("free fGPU")).first.click()
    expect(page.locator("#content")).to_contain_text("demo-node")
    page.screenshot(path=str(shots / "readme-walkthrough-fragmentation.png"), animations="disabled", full_page=True)

    # 7. Terminate from the terminal page.
    ended = re.search(r"the page says `(Session ended: [^`]+)`", steps).group(1)
    page.goto(base + f"/sessions/{created['id']}/terminal/")
    page.click("#terminate-session")
    expect(page.locator("#terminate-dialog")).to_be_visible()
    page.click("#terminate-confirm")
    expect(page.locator("#terminal-status")).to_have_text(ended)
    page.screenshot(path=str(shots / "readme-walkthrough-ended.png"), animations="disabled")
    # No script failed (a missing resource, such as the admin's favicon, is not the walkthrough's).
    assert [e for e in page.js_errors if "Failed to load resource" not in e] == [], page.js_errors


def test_the_full_demo_offers_mig_at_once_and_groups_both_nodes(procs, tmp_path, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    assert "`make run DEMO=full` adds the demo's second node, `demo-mig-node`" in walkthrough()
    port = start_console(procs, tmp_path, demo="full")
    base = f"http://127.0.0.1:{port}"
    page.goto(base + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(base + "/sessions/")

    # The MIG tab: demo-mig-node's profiles with what is free, without a visit to the admin.
    page.click("#start-session")
    expect(page.locator("#options-status")).to_have_text("")
    page.click("#tab-mig")
    expect(page.locator("#panel-mig")).to_be_visible()
    small = page.locator('.mig-profile:has(input[value="1g.10gb"])')
    expect(small.locator(".mig-avail")).to_have_text("7 free now")
    expect(page.locator('.mig-profile:has(input[value="7g.80gb"])')).to_be_visible()
    small.click()
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-mig-node")
    page.locator("#launch-dialog").screenshot(path=str(screenshot_dir() / "readme-walkthrough-mig-tab.png"),
                                              animations="disabled")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    created = info.value.json()
    assert info.value.status == 201, created
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    expect(row.locator("td.configuration")).to_contain_text("MIG 1g.10gb")

    # Whole GPUs (issue 36.1): demo-rocm-node's rocm slot hands out whole devices, from its tab.
    assert "pick **GPU (rocm.device)** under **Accelerator** and the **Whole GPUs** tab" in walkthrough()
    page.click("#start-session")
    expect(page.locator("#options-status")).to_have_text("")
    page.select_option("#slot-select", "rocm.device")
    expect(page.locator("#tab-devices")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#tab-devices")).not_to_have_class(re.compile(r"\btab-unavailable\b"))
    expect(page.locator("#gpu-capacity")).to_contain_text("2 on the largest node")
    page.fill("#gpu-count", "2")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-rocm-node")
    expect(page.locator("#preview-devices tbody tr")).to_have_count(2)
    page.locator("#launch-dialog").screenshot(path=str(screenshot_dir() / "readme-walkthrough-whole-gpus.png"),
                                              animations="disabled")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    whole = info.value.json()
    assert info.value.status == 201 and whole["resources"]["rocm.device"] == 2, whole
    row = page.locator(f'#sessions-table tr[data-session-id="{whole["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    expect(row.locator("td.node")).to_contain_text("demo-rocm-node")

    # The nodes are in the group "default": its fragmentation map names them.
    answer = page.request.get(base + "/api/v1/nodes/")
    nodes = answer.json()
    nodes = nodes.get("results", nodes) if isinstance(nodes, dict) else nodes
    assert {(n["name"], n["resource_group"]) for n in nodes} == {
        ("demo-node", "default"), ("demo-mig-node", "default"), ("demo-rocm-node", "default")}
    page.goto(base + "/admin/compute_sessions/fragmentationmap/")
    page.locator("#result_list").get_by_role("link", name=re.compile("free fGPU")).first.click()
    expect(page.locator("#content")).to_contain_text("demo-node")
    expect(page.locator("#content")).to_contain_text("demo-mig-node")
    page.screenshot(path=str(screenshot_dir() / "readme-walkthrough-full-fragmentation.png"), animations="disabled",
                    full_page=True)
