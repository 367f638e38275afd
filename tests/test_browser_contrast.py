"""An automated accessibility check (issue 18.8): axe-core (tests/vendor/axe-core, vendored) runs in
Chromium on the console's pages — login, the sessions list, the launch dialog, a terminal page —
and on the admin pages the console styles, in the light theme and the dark one, against the
console as `make run` starts it with the demo's MIG node. No page may have a colour-contrast
violation, nor any other violation axe rates serious or critical; a failure lists each rule with
its elements and axe's words. axe does not measure focus rings: the keyboard's ring on the
sessions page's main button and on the admin's Save is measured here, 3:1 at least (WCAG 2.2,
non-text contrast).

The MIG node is set to a fixed layout first, so the node page shows the layout editor and every
state of the slice picture that a fresh node can (in use, idle, free)."""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import ROOT
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_mig import mig_console_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

AXE = ROOT / "tests" / "vendor" / "axe-core" / "axe.min.js"
FAILING_IMPACTS = ("serious", "critical")


def axe_violations(page) -> list[dict]:
    """The violations axe finds on the page as it is now that this check fails on: every
    color-contrast one, and any other rated serious or critical (WCAG 2.x A and AA rules and
    axe's best practices)."""
    # The admin's jQuery runs its ready handlers (select2 set-up among them) after the load event.
    page.evaluate("() => new Promise(done => window.django && window.django.jQuery ? "
                  "window.django.jQuery(() => setTimeout(done)) : done())")
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        # Evaluated through the DevTools protocol, which the console's CSP (script-src 'self': no
        # inline <script>, which add_script_tag would insert) does not govern.
        page.evaluate(AXE.read_text() + "\n;undefined")
    results = page.evaluate("""async () => {
        // Colours as they settle: a button's transition from disabled to enabled (a tab's click
        // re-validates the form) would be measured half-way otherwise.
        // Transitions only: an infinite animation (the live indicator's pulse) never finishes.
        await Promise.all(document.getAnimations().filter(a => a instanceof CSSTransition)
                          .map(a => a.finished.catch(() => null)));
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
            nodes: v.nodes.map(n => ({target: n.target.join(' '), summary: n.failureSummary}))}));
    }""")
    return [v for v in results if v["id"] == "color-contrast" or v["impact"] in FAILING_IMPACTS]


def luminance(rgb: tuple[int, int, int]) -> float:
    def channel(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = map(channel, rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """WCAG 2 contrast ratio of two sRGB colours."""
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def focus_ring(page, selector: str, *, tabs: int = 80) -> tuple[float, str]:
    """Tab (the keyboard, so :focus-visible applies) to `selector`; the contrast of its focus ring
    (an outline of 2 px or more, else the outermost box-shadow's colour) against the first opaque
    background behind it, and the colours, for the message."""
    page.locator("body").focus()
    for _ in range(tabs):
        page.keyboard.press("Tab")
        if page.evaluate("s => document.activeElement && document.activeElement.matches(s)", selector):
            break
    else:
        raise AssertionError(f"Tab never reached {selector}")
    ring, behind = page.evaluate("""async s => {
        const el = document.activeElement;
        await Promise.all(el.getAnimations().map(a => a.finished));  // the ring's transition, if any
        const cs = getComputedStyle(el);
        const opaque = c => !/^rgba\\(.*,\\s*0?\\.\\d+\\)$|^rgba\\(.*,\\s*0\\)$/.test(c);
        let ring = null;
        if (cs.outlineStyle !== 'none' && parseFloat(cs.outlineWidth) >= 2) ring = cs.outlineColor;
        else ring = (cs.boxShadow.match(/rgba?\\([^)]+\\)/g) || []).filter(opaque).pop() || null;
        let node = el.parentElement, bg = 'rgb(255, 255, 255)';
        while (node) {
            const b = getComputedStyle(node).backgroundColor;
            if (b && b !== 'transparent' && !/rgba\\(.*, 0\\)$/.test(b)) { bg = b; break; }
            node = node.parentElement;
        }
        return [ring, bg];
    }""", selector)
    assert ring, f"{selector} shows no focus ring"
    parse = lambda text: tuple(int(float(v)) for v in re.findall(r"[\d.]+", text)[:3])  # noqa: E731
    return contrast(parse(ring), parse(behind)), f"{ring} on {behind}"


def describe(where: str, violations: list[dict]) -> str:
    lines = []
    for v in violations:
        lines.append(f"{where}: {v['id']} ({v['impact']}): {v['help']}")
        lines.extend(f"    {n['target']}: {n['summary'].splitlines()[-1].strip()}" for n in v["nodes"][:8])
    return "\n".join(lines)


def log_in(page, base: str) -> None:
    from playwright.sync_api import expect

    page.goto(base + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(base + "/sessions/")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")


def api(page, base: str, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    answer = page.request.fetch(base + path, method=method, data=json.dumps(body) if body is not None else None,
                                headers={"Content-Type": "application/json",
                                         "X-CSRFToken": next(c["value"] for c in page.context.cookies()
                                                             if c["name"] == "csrftoken"), **(headers or {})})
    assert answer.ok, (path, answer.status, answer.text())
    return answer


def test_console_and_admin_pages_have_no_contrast_nor_serious_accessibility_violations(mig_console_url, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    base = mig_console_url
    found: list[str] = []

    def check(where: str) -> None:
        violations = axe_violations(page)
        if violations:
            found.append(describe(where, violations))

    # Logged out: the login page.
    page.goto(base + "/login/")
    check("login")

    # The sessions list with a running session, the launch dialog, the terminal page.
    log_in(page, base)
    mig = api(page, base, "GET", "/api/v1/nodes/demo-mig-node/mig/")
    api(page, base, "PATCH", "/api/v1/nodes/demo-mig-node/mig/",
        {"mig_mode": "fixed", "mig_layout": {"0": [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}]}},
        {"If-Match": mig.headers["etag"]})
    created = api(page, base, "POST", "/api/v1/sessions/",
                  {"name": "contrast", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}}).json()
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    check("sessions page")
    ratio, colours = focus_ring(page, "#start-session")
    if ratio < 3:
        found.append(f"sessions page: the focus ring of Start a session is {ratio:.2f}:1 ({colours}), under 3:1")

    page.click("#start-session")
    expect(page.locator("#launch-dialog")).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
    expect(page.locator("#preview-line")).not_to_be_empty()
    check("launch dialog")
    # Every request tab the dialog shows (a tab the cluster cannot serve carries a note instead).
    tabs = page.locator("#launch-dialog [role=tab]")
    for n in range(tabs.count()):
        tab = tabs.nth(n)
        if not tab.is_visible():
            continue
        tab.click()
        expect(tab).to_have_attribute("aria-selected", "true")
        expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
        check(f"launch dialog, tab {tab.inner_text().strip()!r}")
    page.keyboard.press("Escape")
    expect(page.locator("#launch-dialog")).to_be_hidden()

    page.goto(base + f"/sessions/{created['id']}/terminal/")
    expect(page.locator("#terminal .xterm-rows")).to_be_visible()
    check("terminal page")

    page.goto(base + "/account/")
    check("profile page")

    # The admin pages the console styles, in both themes.
    node_id = page.request.get(base + "/api/v1/nodes/demo-mig-node/").json()["id"]
    admin_pages = {
        "admin index": "/admin/",
        "admin nodes": "/admin/accelerators/node/",
        "admin MIG node (editor, slice picture)": f"/admin/accelerators/node/{node_id}/change/",
        "admin devices": "/admin/accelerators/device/",
        "admin fractional settings": "/admin/accelerators/fractionalsettings/",
        "admin import page": "/admin/accelerators/slotformat/import/",
        "admin sessions": "/admin/compute_sessions/computesession/",
        "admin session": f"/admin/compute_sessions/computesession/{created['id']}/change/",
        "admin quota form": "/admin/compute_sessions/quota/add/",
        "admin tokens": "/admin/accounts/apitoken/",
        "admin users": "/admin/auth/user/",
        "admin preset form": "/admin/compute_sessions/resourcepreset/add/",
        "admin session images": "/admin/compute_sessions/sessionimage/",
        "admin usage report": "/admin/usage/usagereport/",
    }
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        for where, path in admin_pages.items():
            page.goto(base + path)
            expect(page.locator("#content")).to_be_visible()
            if "editor" in where:
                expect(page.locator(".mig-layout-status")).to_have_text("✓ This layout can be created on the GPUs.")
            check(f"{where} ({scheme})")
            if where == "admin quota form":
                ratio, colours = focus_ring(page, "input[name=_save]")
                if ratio < 3:
                    found.append(f"{where} ({scheme}): the focus ring of Save is {ratio:.2f}:1 ({colours}), under 3:1")

    assert not found, "\n" + "\n".join(found)
