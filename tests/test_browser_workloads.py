"""The workload table and the terminal page in a real browser (issue 18, items 2 and 8), against
the console as `make run` starts it: `manage.py standalone` in a subprocess with the demo node
and the demo MIG node, Debian's chromium driven by Playwright, desktop (1280×800) and phone
(390×844).

- An administrator's list shows every session with its owner, live elapsed times, All /
  Running / Finished tabs, status, owner and node filters, pages of 25 and long pending reasons
  cut to two lines with the whole text on demand; unnamed sessions get names unique per owner.
- A user's list has no Owner column and holds only their sessions; at 390 px nothing in the
  list or the launch dialog overlaps or is clipped.
- The terminal page terminates its session (with the list's confirmation) and says how a
  session ended in words: "terminated by you", "exited with code 3", "killed by signal 9
  (SIGKILL)".
- After a server restart both pages show the current states (the agent's sessions ended in
  ERROR) within 5 s of the server answering again, still signed in; a signed-out page asks to
  sign in again and comes back to the same place.
- The focus ring and disabled buttons meet WCAG AA contrast; "API docs" opens /api/docs/.

Screenshots go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/ (workloads-*.png).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT, free_port, wait_until
from tests.stack import ApiClient
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, answers, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

AGENTS = f"{ROOT / 'demo' / 'agent.toml'},{ROOT / 'demo' / 'agent-mig-h100.toml'}"
BOB_PASSWORD = "bob-workload-pass"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 800}


class Standalone:
    """`manage.py standalone` on a fixed port and data directory, which can be stopped and
    started again (a restart keeps the SQLite database, as `make run` does)."""

    def __init__(self, procs, tmp_path):
        self.procs, self.port = procs, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Without pytest-django's DJANGO_SETTINGS_MODULE, which would win over standalone's own.
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
        self.env.update(FGPU_DATA_DIR=str(tmp_path / "data"), FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD,
                        PORT=str(self.port), PYTHONUNBUFFERED="1", FGPU_AGENT_CONFIG=AGENTS)
        self.server = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.server = self.procs.start(f"standalone-{self.starts}", [sys.executable, "manage.py", "standalone"],
                                       self.env)
        server = self.server

        def ready():
            assert server.popen.poll() is None, f"standalone exited:\n{server.output()}"
            return "fGPU Console is serving on" in server.output() and answers(self.url + "/login/")

        wait_until(ready, timeout=90, interval=0.1, what="the standalone console to serve /login/")

    def stop(self) -> None:
        self.server.stop()

    def manage(self, code: str) -> None:
        """Run Python in `manage.py shell` against the console's database."""
        env = {**self.env, "DJANGO_SETTINGS_MODULE": "console.settings_standalone"}
        subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=env, check=True,
                       timeout=120, capture_output=True)

    def api(self, username: str, password: str) -> ApiClient:
        request = urllib.request.Request(self.url + "/api/v1/auth/token/", method="POST",
                                         data=json.dumps({"username": username, "password": password}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=15) as response:
            return ApiClient(self.url, json.loads(response.read())["token"])


@pytest.fixture
def console(procs, tmp_path):
    console = Standalone(procs, tmp_path)
    console.start()
    return console


@pytest.fixture
def browser(page):
    """The walkthrough's chromium (tests/test_browser.py), for pages with cookies and sizes of their own."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    return page.context.browser


def new_page(browser, viewport=DESKTOP):
    """A page in a context of its own (its own cookies), collecting the page's JS errors."""
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(f"uncaught: {exc}"))
    page.on("console", lambda msg: page.js_errors.append(f"console.{msg.type}: {msg.text}")
            if msg.type == "error" and "Failed to load resource" not in msg.text
            and "WebSocket connection" not in msg.text else None)
    return page


def log_in(page, base, username="admin", password=ADMIN_PASSWORD, path="/sessions/"):
    from playwright.sync_api import expect

    page.goto(base + "/login/?next=" + path)
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-submit")
    expect(page).to_have_url(base + path)
    if path.startswith("/sessions/"):
        expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")


def statuses(page) -> list[str]:
    return page.locator("#sessions-body td.status .badge").all_text_contents()


def wait_status(api: ApiClient, session_id: str, wanted: str, timeout: float = 30) -> dict:
    def reached():
        _, body = api.call("GET", f"/api/v1/sessions/{session_id}/")
        return body if body.get("status") == wanted else None

    return wait_until(reached, timeout=timeout, interval=0.2, what=f"session {session_id} {wanted}")


def ring_and_text_contrast(page, selector: str) -> dict:
    """WCAG contrast ratios of `selector`: its text on its background, and its focus ring (the
    last colour of its box-shadow) on the background of its parent."""
    return page.evaluate("""(selector) => {
      const el = document.querySelector(selector);
      const rgb = (text) => (text.match(/rgba?\\(([^)]+)\\)/g) || []).map(c => c.match(/[\\d.]+/g).map(Number));
      const lum = ([r, g, b]) => [r, g, b].map(v => v / 255).map(c => c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4)
        .reduce((s, c, i) => s + c * [0.2126, 0.7152, 0.0722][i], 0);
      const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
      const background = (node) => {
        for (; node; node = node.parentElement) {
          const c = rgb(getComputedStyle(node).backgroundColor)[0];
          if (c && (c.length < 4 || c[3] > 0)) return c;
        }
        return [255, 255, 255];
      };
      const style = getComputedStyle(el);
      const ring = rgb(style.boxShadow).pop();
      return {text: ratio(rgb(style.color)[0], background(el)),
              ring: ring ? ratio(ring, background(el.parentElement)) : 0, shadow: style.boxShadow};
    }""", selector)


# --- the administrator's table ---------------------------------------------------------------------

def test_an_admin_sees_owners_tabs_filters_pages_live_elapsed_times_and_whole_reasons_on_demand(console, browser):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    console.manage("from django.contrib.auth import get_user_model; "
                   f"get_user_model().objects.create_user('bob', password='{BOB_PASSWORD}')")
    admin, bob = console.api("admin", ADMIN_PASSWORD), console.api("bob", BOB_PASSWORD)

    # bob fills demo-node's GPU (2 fGPU) with two unnamed sessions: each gets a name of its own.
    bobs = [bob.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": "1", "mem": "64M"}})[1]
            for _ in range(2)]
    assert [s["name"] for s in bobs] == ["session-1", "session-2"], bobs
    for s in bobs:
        wait_status(bob, s["id"], "RUNNING")
    # The admin's 27 unnamed sessions wait for demo-node's GPU (no node has MIG on: the MIG
    # node's GPU is shared too, so pin to demo-node's GPU 0), 20 of them then cancelled.
    gpu = bob.call("GET", "/api/v1/nodes/demo-node/")[1]["devices"][0]["device_id"]
    mine = [admin.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": "0.25", "mem": "64M",
                                                                    "devices": [gpu]}})[1] for _ in range(27)]
    names = [s["name"] for s in mine]
    assert names == [f"session-{n}" for n in range(1, 28)], names  # unique per owner, in launch order
    assert all(s["status"] == "PENDING" for s in mine), [s["status"] for s in mine]
    for s in mine[:20]:
        assert admin.call("DELETE", f"/api/v1/sessions/{s['id']}/")[0] == 202

    page = new_page(browser)
    log_in(page, console.url)
    table = page.locator("#sessions-table")

    # Owner column; 29 sessions in pages of 25, newest first.
    expect(table.locator("thead th")).to_contain_text(["Name", "Owner", "Status", "Configuration", "Node",
                                                        "Elapsed"])
    expect(page.locator("#list-range")).to_have_text("1–25 of 29")
    expect(page.locator("#sessions-body tr")).to_have_count(25)
    expect(page.locator("#sessions-body tr").first.locator("td.name")).to_have_text("session-27")
    expect(page.locator("#sessions-body tr").first.locator("td.owner")).to_have_text("admin")

    # A waiting session's long reason: two lines, the whole of it on demand.
    # (A waiting session's row is redrawn whenever a pass rewrites its reason: the first one with a
    # long reason, found anew at each look, not whichever row is first at the moment of a look.)
    cell = page.locator('#sessions-body tr[data-status="PENDING"] td.status[data-long]').first
    expect(cell).to_have_text("PENDING")  # the reason is drawn from data-reason, not the cell's text
    reason = cell.get_attribute("data-reason")
    assert reason.startswith("waiting for capacity") and len(reason) > 90, reason
    clamp = lambda: cell.evaluate("td => getComputedStyle(td, '::after').webkitLineClamp")  # noqa: E731
    height = lambda: cell.evaluate("td => td.getBoundingClientRect().height")  # noqa: E731
    # The cell is looked up anew at each look; a pass redrawing its row in between reads '' once.
    wait_until(lambda: clamp() == "2", timeout=10, interval=0.1, what="the long reason clamped to two lines")
    short = height()
    toggle = cell.locator("button.reason-toggle")
    expect(toggle).to_have_attribute("aria-expanded", "false")
    toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    assert clamp() == "none" and height() > short + 10, (clamp(), height(), short)
    page.screenshot(path=str(shots / "workloads-list-admin.png"), animations="disabled")

    # Older →: the last 4; the address keeps the place, and a reload lands on it again.
    page.click("#page-next")
    expect(page.locator("#list-range")).to_have_text("26–29 of 29")
    expect(page).to_have_url(console.url + "/sessions/?page=2")
    page.reload()
    expect(page.locator("#list-range")).to_have_text("26–29 of 29")
    expect(page.locator("#sessions-body tr")).to_have_count(4)

    # Elapsed times run: bob's RUNNING sessions (the oldest) count up each second.
    running = page.locator('#sessions-body tr[data-status="RUNNING"] td.elapsed .elapsed-text').first
    first = running.text_content()
    assert re.fullmatch(r"(\d+s|\d+m \d\ds)", first), first
    expect(running).not_to_have_text(first, timeout=5000)

    # Tabs: Finished holds the 20 cancelled, Running the 9 others.
    page.click('.list-tab[data-tab="finished"]')
    expect(page).to_have_url(console.url + "/sessions/?tab=finished")
    expect(page.locator("#list-range")).to_have_text("1–20 of 20")
    assert set(statuses(page)) == {"CANCELLED"}, statuses(page)
    page.click('.list-tab[data-tab="running"]')
    expect(page.locator("#list-range")).to_have_text("1–9 of 9")
    assert set(statuses(page)) == {"PENDING", "RUNNING"}, statuses(page)

    # Filters: owner, then node and status; each narrows the rows and the address says so.
    page.select_option("#filter-owner", "bob")
    expect(page.locator("#list-range")).to_have_text("1–2 of 2")
    expect(page.locator("#sessions-body td.owner")).to_have_text(["bob", "bob"])
    expect(page.locator("#sessions-body td.name")).to_have_text(["session-2", "session-1"])
    page.select_option("#filter-owner", "")
    page.select_option("#filter-node", "demo-node")
    expect(page.locator("#list-range")).to_have_text("1–2 of 2")  # the waiting ones have no node yet
    expect(page.locator("#sessions-body td.node .node-name")).to_have_text(["demo-node", "demo-node"])
    page.select_option("#filter-node", "")
    page.select_option("#filter-status", "PENDING")
    expect(page).to_have_url(console.url + "/sessions/?tab=running&status=PENDING")
    expect(page.locator("#list-range")).to_have_text("1–7 of 7")
    page.select_option("#filter-owner", "bob")
    expect(page.locator("#sessions-empty")).to_be_visible()
    expect(page.locator("#empty-title")).to_have_text("No sessions match these filters")
    page.click("#filters-clear")
    expect(page.locator("#list-range")).to_have_text("1–9 of 9")

    # A session that changes moves in place, live: bob ends one; its row says so.
    bob.call("DELETE", f"/api/v1/sessions/{bobs[0]['id']}/")
    row = page.locator(f'#sessions-body tr[data-session-id="{bobs[0]["id"]}"]')
    expect(row.locator("td.status")).to_have_text("TERMINATED")
    expect(row.locator("td.status")).to_have_attribute("data-reason", "terminated by bob")
    assert page.js_errors == [], page.js_errors


# --- a user on a phone -----------------------------------------------------------------------------

def overlaps(page, selector: str) -> list:
    """Pairs of elements matched by `selector` whose boxes intersect, and elements that reach
    past the viewport or whose content is wider than their box (clipped)."""
    return page.evaluate("""(selector) => {
      const els = Array.from(document.querySelectorAll(selector)).filter(e => e.getClientRects().length);
      const box = e => e.getBoundingClientRect();
      const out = [];
      els.forEach((a, i) => {
        const r = box(a);
        if (r.right > innerWidth + 0.5 || r.left < -0.5) out.push(['outside', a.className || a.id, r.left, r.right]);
        if (a.scrollWidth > a.clientWidth + 1 && getComputedStyle(a).overflowX !== 'auto')
          out.push(['clipped', a.className || a.id, a.textContent.trim().slice(0, 30)]);
        els.slice(i + 1).forEach(b => {
          const q = box(b);
          if (a.contains(b) || b.contains(a)) return;
          if (r.left < q.right - 0.5 && q.left < r.right - 0.5 && r.top < q.bottom - 0.5 && q.top < r.bottom - 0.5)
            out.push(['overlap', a.className || a.id, b.className || b.id, a.textContent.trim().slice(0, 20),
                      b.textContent.trim().slice(0, 20)]);
        });
      });
      return out;
    }""", selector)


def test_a_user_on_a_phone_sees_only_their_sessions_without_owners_and_nothing_overlaps_or_is_clipped(
        console, browser):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    console.manage("from django.contrib.auth import get_user_model; "
                   f"get_user_model().objects.create_user('bob', password='{BOB_PASSWORD}')")
    admin, bob = console.api("admin", ADMIN_PASSWORD), console.api("bob", BOB_PASSWORD)
    admin.call("POST", "/api/v1/sessions/", {"name": "admins-own", "resources": {"cpu": 1, "mem": "64M"}})
    theirs = bob.call("POST", "/api/v1/sessions/", {"name": "train-resnet50-on-imagenet-with-a-long-name",
                                                    "resources": {"gpu_memory": "15G", "isolation": "any"}})[1]
    wait_status(bob, theirs["id"], "RUNNING")  # a shared slice, with the grant's words under it
    bob.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": "2", "mem": "64M"}})

    page = new_page(browser, PHONE)
    log_in(page, console.url, "bob", BOB_PASSWORD)
    expect(page.locator("#sessions-body tr")).to_have_count(2)
    expect(page.locator("#sessions-body td.name")).to_have_text(
        ["session-1", "train-resnet50-on-imagenet-with-a-long-name"])
    expect(page.locator("#sessions-table th", has_text="Owner")).to_have_count(0)
    expect(page.locator("#sessions-body td.owner")).to_have_count(0)
    expect(page.locator("#filter-owner")).to_have_count(0)
    assert page.evaluate("document.documentElement.scrollWidth") == PHONE["width"]

    # Every card: labels and values side by side, none over another, none clipped.
    for row in range(2):
        cells = f"#sessions-body tr:nth-child({row + 1}) td > *"
        assert overlaps(page, cells) == [], overlaps(page, cells)
    # A usage gauge's words wrap in the card, whatever they say (CI's slow agents sent no sample
    # in the last minute once, and the longer words were clipped): never clipped.
    page.evaluate("document.querySelectorAll('.usage-gauge-text')"
                  ".forEach(t => { t.textContent = 'no recent sample of this session / 1023.9 GiB'; })")
    assert overlaps(page, "#sessions-body td > *") == [], overlaps(page, "#sessions-body td > *")
    assert overlaps(page, ".list-tab, .filter, #start-session, #live-indicator") == []
    page.screenshot(path=str(shots / "workloads-list-phone.png"), full_page=True, animations="disabled")

    # The launch dialog at 390 px: every tab, isolation segment and button whole, none over another.
    console.manage("from accelerators.models import Node; "
                   "Node.objects.filter(name='demo-mig-node').update(mig_mode='dynamic')")
    page.reload()
    page.click("#start-session")
    dialog = page.locator("#launch-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    expect(page.locator("#tab-mig")).to_be_visible()
    page.click("#tab-memory")
    expect(page.locator("#isolation-field")).to_be_visible()
    page.locator("#isolation-field .segments").scroll_into_view_if_needed()
    assert overlaps(page, "#style-tabs .tab") == [], overlaps(page, "#style-tabs .tab")
    assert overlaps(page, "#isolation-field .segment") == [], overlaps(page, "#isolation-field .segment")
    assert overlaps(page, ".dialog-footer > *") == [], overlaps(page, ".dialog-footer > *")
    for selector in ("#style-tabs .tab:not([hidden])", "#isolation-field .segment", ".dialog-footer .button"):
        for box in page.locator(selector).all():
            inside = box.evaluate("(e) => { const r = e.getBoundingClientRect(), d = e.closest('dialog')"
                                  ".getBoundingClientRect(); return r.left >= d.left && r.right <= d.right; }")
            assert inside, (selector, box.text_content())
    dialog.screenshot(path=str(shots / "workloads-dialog-phone.png"), animations="disabled")
    page.click("#tab-mig")
    page.locator("#mig-profiles").scroll_into_view_if_needed()
    expect(page.locator("#mig-profiles .mig-profile").first).to_be_visible()
    expect(page.locator("#preview-config")).to_contain_text("MIG 1g.10gb")  # the preview of the MIG tab
    assert overlaps(page, "#mig-profiles .mig-profile:first-child > span") == []
    dialog.screenshot(path=str(shots / "workloads-dialog-mig-phone.png"), animations="disabled")
    assert page.js_errors == [], page.js_errors


# --- the terminal page -----------------------------------------------------------------------------

def shell_ready(page):
    from tests.test_browser import terminal_lines

    def prompt():
        lines = [line for line in terminal_lines(page) if line]
        return lines and re.search(r"[$#%>]$", lines[-1])

    wait_until(prompt, timeout=20, what="the shell's prompt in the terminal")


def test_the_terminal_page_terminates_its_session_and_says_how_sessions_ended_in_words(console, browser):
    from playwright.sync_api import expect

    shots = screenshot_dir()
    admin = console.api("admin", ADMIN_PASSWORD)
    sessions = [admin.call("POST", "/api/v1/sessions/", {"name": name, "resources": {"cuda.shares": "0.25"}})[1]
                for name in ("to-terminate", "exits-3", "killed")]
    for s in sessions:
        wait_status(admin, s["id"], "RUNNING")

    for viewport, label in ((DESKTOP, "desktop"), (PHONE, "phone")):
        page = new_page(browser, viewport)
        log_in(page, console.url)
        page.goto(console.url + sessions[0]["terminal_url"])
        if label == "desktop":
            expect(page.locator("#terminal-status")).to_have_text("Connected")
            expect(page.locator("#session-status-badge")).to_have_text("RUNNING")
            expect(page.locator("#session-elapsed")).to_have_text(re.compile(r"^\d+(s|m \d\ds)$"))
            page.click("#terminate-session")
            expect(page.locator("#terminate-dialog")).to_be_visible()
            expect(page.locator("#terminate-name")).to_have_text("to-terminate")
            page.screenshot(path=str(shots / "workloads-terminal-terminate-desktop.png"), animations="disabled")
            page.click("#terminate-confirm")
            expect(page.locator("#session-status-badge")).to_have_text("TERMINATED")
            expect(page.locator("#terminal-banner-text")).to_have_text("Session ended: terminated by you")
            expect(page.locator("#session-reason")).to_have_text("terminated by you")
            expect(page.locator("#terminate-session")).to_be_hidden()
            expect(page.locator("#session-elapsed")).to_have_text(re.compile(r"^ran "))
        else:  # the same page of an ended session, opened later: the same words
            expect(page.locator("#session-status-badge")).to_have_text("TERMINATED")
            expect(page.locator("#terminal-banner-text")).to_have_text("Session ended: terminated by you")
            expect(page.locator("#terminate-session")).to_be_hidden()
        page.screenshot(path=str(shots / f"workloads-terminal-ended-{label}.png"), animations="disabled")
        assert page.js_errors == [], page.js_errors

        if label == "desktop":
            for session, typed, words in ((sessions[1], "exit 3", "exited with code 3"),
                                          (sessions[2], "kill -9 $$", "killed by signal 9 (SIGKILL)")):
                page.goto(console.url + session["terminal_url"])
                expect(page.locator("#terminal-status")).to_have_text("Connected")
                shell_ready(page)
                page.locator("#terminal").click()
                page.keyboard.type(typed)
                page.keyboard.press("Enter")
                expect(page.locator("#terminal-banner-text")).to_have_text(f"Session ended: {words}")
                expect(page.locator("#session-status-badge")).to_have_text("TERMINATED")
            page.goto(console.url + "/sessions/?tab=finished")
            expect(page.locator("#sessions-body td.status")).to_have_count(3)
            reasons = [cell.get_attribute("data-reason") for cell in page.locator("#sessions-body td.status").all()]
            assert reasons == ["killed by signal 9 (SIGKILL)", "exited with code 3", "terminated by you"], reasons
        page.context.close()


# --- restarts and signing in again ------------------------------------------------------------------

def test_after_a_server_restart_both_pages_show_the_current_states_within_5_s_still_signed_in(console, browser):
    from playwright.sync_api import expect

    admin = console.api("admin", ADMIN_PASSWORD)
    session = admin.call("POST", "/api/v1/sessions/", {"name": "survivor?", "resources": {"cuda.shares": "0.5"}})[1]
    wait_status(admin, session["id"], "RUNNING")

    page = new_page(browser)
    log_in(page, console.url)
    row = page.locator(f'#sessions-body tr[data-session-id="{session["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    terminal = page.context.new_page()
    terminal.goto(console.url + session["terminal_url"])
    expect(terminal.locator("#terminal-status")).to_have_text("Connected")
    expect(terminal.locator("#session-status-badge")).to_have_text("RUNNING")

    console.stop()
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "reconnecting")
    expect(terminal.locator("#terminal-status")).to_contain_text("reconnecting")
    console.start()  # returns once the login page answers; the restarted agent runs nothing
    back = time.monotonic()

    # Within 5 s: the row and the terminal page say ERROR (the agent restarted), both still signed in.
    expect(row.locator("td.status")).to_have_text("ERROR", timeout=5000)
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live", timeout=5000)
    left_ms = max(1, 5 - (time.monotonic() - back)) * 1000
    expect(terminal.locator("#session-status-badge")).to_have_text("ERROR", timeout=left_ms)
    expect(terminal.locator("#terminal-banner-text")).to_have_text(
        "Session ended: the agent restarted and no longer runs this session")
    assert time.monotonic() - back < 6  # both pages within 5 s (and the last check's own time)
    expect(page.locator("#signed-out")).to_have_count(0)
    expect(terminal.locator("#signed-out")).to_have_count(0)
    page.screenshot(path=str(screenshot_dir() / "workloads-after-restart.png"), animations="disabled")
    terminal.screenshot(path=str(screenshot_dir() / "workloads-terminal-after-restart.png"), animations="disabled")
    assert page.js_errors == [], page.js_errors


def test_a_signed_out_page_asks_to_sign_in_again_and_the_sign_in_returns_to_the_same_place(console, browser):
    from playwright.sync_api import expect

    page = new_page(browser)
    log_in(page, console.url, path="/sessions/?tab=finished")
    expect(page.locator('.list-tab[aria-current="page"]')).to_have_text("Finished")

    page.context.clear_cookies()  # signed out elsewhere, or the sign-in expired
    page.select_option("#filter-status", "ERROR")
    notice = page.locator("#signed-out")
    expect(notice).to_be_visible()
    expect(notice).to_contain_text("You are signed out")
    expect(page.locator("body")).not_to_contain_text("Authentication credentials were not provided")
    link = page.locator("#sign-in-again")
    expect(link).to_have_attribute("href", "/login/?next=" + "%2Fsessions%2F%3Ftab%3Dfinished%26status%3DERROR")
    page.screenshot(path=str(screenshot_dir() / "workloads-signed-out.png"), animations="disabled")

    link.click()
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(console.url + "/sessions/?tab=finished&status=ERROR")
    expect(page.locator("#filter-status")).to_have_value("ERROR")
    expect(page.locator("#signed-out")).to_have_count(0)
    assert [e for e in page.js_errors if "401" not in e] == [], page.js_errors


# --- small details: API docs, contrast -----------------------------------------------------------

def test_api_docs_open_swagger_and_the_focus_ring_and_disabled_buttons_meet_wcag_aa_contrast(console, browser):
    from playwright.sync_api import expect

    page = new_page(browser)
    log_in(page, console.url)

    # The focus ring, reached with the keyboard: 3:1 against what surrounds it (WCAG 1.4.11).
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "start-session":
            break
    focused = ring_and_text_contrast(page, "#start-session:focus-visible")
    assert focused["ring"] >= 3, focused
    page.locator(".page-header").screenshot(path=str(screenshot_dir() / "workloads-focus-ring.png"))
    page.focus("#profile-link")
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Tab")
    on_top_bar = ring_and_text_contrast(page, "#profile-link:focus-visible")
    assert on_top_bar["ring"] >= 3, on_top_bar  # the dark top bar has its own ring

    # Disabled buttons keep their words readable: 4.5:1 (WCAG 1.4.3).
    page.click("#start-session")
    expect(page.locator("#options-status")).to_have_text("")
    page.click("#tab-fraction")
    page.fill("#gpu-fraction", "2")
    expect(page.locator("#launch-submit")).to_be_disabled()
    disabled = ring_and_text_contrast(page, "#launch-submit")
    assert disabled["text"] >= 4.5, disabled
    page.locator("#launch-dialog .dialog-footer").screenshot(path=str(screenshot_dir() / "workloads-launch-disabled.png"))
    page.keyboard.press("Escape")

    # "API docs": the Swagger UI of the OpenAPI schema, not DRF's root view.
    page.click("nav.nav >> text=API docs")
    expect(page).to_have_url(console.url + "/api/docs/")
    expect(page.locator("#swagger-ui")).to_have_count(1)
