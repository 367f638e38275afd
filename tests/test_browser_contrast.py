"""An automated accessibility check (issues 18.8 and 36.6): axe-core (tests/vendor/axe-core,
vendored) runs in Chromium on every console page — login, the sessions list empty and with a running
session, the launch dialog and each of its tabs, a terminal page with its charts, the profile with
a new token shown once, the API docs' page — in the light theme and the dark one, at a desktop width
and the sessions page with its phone menu open at 390 px; and on the admin pages the console
styles, in both themes, against the console as `make run` starts it with the demo's MIG node. A
console page may have no violation at all (any rule, any impact); an admin page, and Swagger UI's
own markup, none for colour contrast nor any other axe rates serious or critical (Swagger UI's
operation summaries nest their buttons: nested-interactive is its markup's, not ours). A failure
lists each rule with its elements and axe's words. axe does not measure focus rings: the keyboard's
ring on the sessions page's main button (both themes) and on the admin's Save is measured here, 3:1
at least (WCAG 2.2, non-text contrast). The theme toggle outranks the system's theme and is kept
across pages, the admin's included; the usage charts' grid is quiet in the dark theme (no glare).

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
SCHEMES = ("light", "dark")


def axe_violations(page, *, strict: bool = False, ignore: tuple[str, ...] = ()) -> list[dict]:
    """The violations axe finds on the page as it is now that this check fails on: with `strict`
    (the console's own pages) every one; else every color-contrast one, and any other rated
    serious or critical (WCAG 2.x A and AA rules and axe's best practices). Rules in `ignore` are
    not counted."""
    # The admin's jQuery runs its ready handlers (select2 set-up among them) after the load event.
    page.evaluate("() => new Promise(done => window.django && window.django.jQuery ? "
                  "window.django.jQuery(() => setTimeout(done)) : done())")
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        # Evaluated through the DevTools protocol, which the console's CSP (script-src 'self': no
        # inline <script>, which add_script_tag would insert) does not govern.
        page.evaluate(AXE.read_text() + "\n;undefined")
    results = page.evaluate("""async () => {
        // Not while a part reloads: a list or preview marked aria-busy is drawn faded on purpose.
        for (let wait = 0; document.querySelector('[aria-busy="true"]') && wait < 100; wait++) {
            await new Promise(done => setTimeout(done, 50));
        }
        // Colours as they settle: a button's transition from disabled to enabled (a tab's click
        // re-validates the form) would be measured half-way otherwise.
        // Transitions only: an infinite animation (the live indicator's pulse) never finishes.
        await Promise.all(document.getAnimations().filter(a => a instanceof CSSTransition)
                          .map(a => a.finished.catch(() => null)));
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
            nodes: v.nodes.map(n => ({target: n.target.join(' '), summary: n.failureSummary}))}));
    }""")
    results = [v for v in results if v["id"] not in ignore]
    if strict:
        return results
    return [v for v in results if v["id"] == "color-contrast" or v["impact"] in FAILING_IMPACTS]


def luminance(rgb: tuple[int, int, int]) -> float:
    def channel(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = map(channel, rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def parse_rgb(text: str) -> tuple[int, int, int]:
    """(r, g, b) of a computed colour, "rgb(1, 2, 3)" or "rgba(1, 2, 3, 0.5)"."""
    r, g, b = (int(float(v)) for v in re.findall(r"[\d.]+", text)[:3])
    return r, g, b


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

    def check(where: str, **how) -> None:
        violations = axe_violations(page, **how)
        if violations:
            found.append(describe(where, violations))

    # Logged out: the login page, in both themes.
    for scheme in SCHEMES:
        page.emulate_media(color_scheme=scheme)
        page.goto(base + "/login/")
        check(f"login ({scheme})", strict=True)

    # The empty sessions list (its own Start a session button opens the dialog).
    page.emulate_media(color_scheme="light")
    log_in(page, base)
    for scheme in SCHEMES:
        page.emulate_media(color_scheme=scheme)
        expect(page.locator("#sessions-empty")).to_be_visible()
        check(f"sessions page, empty ({scheme})", strict=True)
    page.click("#empty-start-session")
    expect(page.locator("#launch-dialog")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#launch-dialog")).to_be_hidden()

    # The sessions list with a running session, the launch dialog, the terminal page, the profile.
    mig = api(page, base, "GET", "/api/v1/nodes/demo-mig-node/mig/")
    api(page, base, "PATCH", "/api/v1/nodes/demo-mig-node/mig/",
        {"mig_mode": "fixed", "mig_layout": {"0": [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}]}},
        {"If-Match": mig.headers["etag"]})
    created = api(page, base, "POST", "/api/v1/sessions/",
                  {"name": "contrast", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}}).json()
    for scheme in SCHEMES:
        page.emulate_media(color_scheme=scheme)
        page.goto(base + "/sessions/")
        row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
        expect(row.locator("td.status")).to_have_text("RUNNING")
        check(f"sessions page ({scheme})", strict=True)
        ratio, colours = focus_ring(page, "#start-session")
        if ratio < 3:
            found.append(f"sessions page ({scheme}): the focus ring of Start a session is {ratio:.2f}:1 ({colours}), under 3:1")

        page.click("#start-session")
        expect(page.locator("#launch-dialog")).to_be_visible()
        expect(page.locator("#options-status")).to_have_text("")
        expect(page.locator("#launch-preview")).not_to_have_attribute("data-pending", "")
        expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
        expect(page.locator("#preview-line")).not_to_be_empty()
        check(f"launch dialog ({scheme})", strict=True)
        # Every request tab the dialog shows (a tab the cluster cannot serve carries a note instead).
        tabs = page.locator("#launch-dialog [role=tab]")
        for n in range(tabs.count()):
            tab = tabs.nth(n)
            if not tab.is_visible():
                continue
            tab.click()
            expect(tab).to_have_attribute("aria-selected", "true")
            # The preview asks again 250 ms after the click: axe must see its answer, not the old one dimmed
            # by aria-busy while it is asked (a contrast of 4.49 under load, pytest-xdist at load 20).
            expect(page.locator("#launch-preview")).not_to_have_attribute("data-pending", "")
            expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
            check(f"launch dialog, tab {tab.inner_text().strip()!r} ({scheme})", strict=True)
        page.keyboard.press("Escape")
        expect(page.locator("#launch-dialog")).to_be_hidden()

        page.goto(base + f"/sessions/{created['id']}/terminal/")
        expect(page.locator("#terminal .xterm-rows")).to_be_visible()
        check(f"terminal page ({scheme})", strict=True)
        # The charts' grid: quiet on the panel, and in the dark theme no light line that glares.
        grid, panel = page.evaluate("""() => {
            const probe = document.createElement('span');
            document.querySelector('.usage-panel').appendChild(probe);
            probe.style.color = 'var(--chart-grid)';
            const colours = [getComputedStyle(probe).color, getComputedStyle(probe.parentElement).backgroundColor];
            probe.remove();
            return colours;
        }""")
        grid_rgb, panel_rgb = parse_rgb(grid), parse_rgb(panel)
        if not 1.1 <= contrast(grid_rgb, panel_rgb) <= 2.5 or (scheme == "dark" and luminance(grid_rgb) > 0.1):
            found.append(f"terminal page ({scheme}): the charts' grid {grid} on {panel} glares or vanishes")

        page.goto(base + "/account/")
        check(f"profile page ({scheme})", strict=True)
        page.fill("#token-name", f"contrast-{scheme}")
        page.click("#create-token")
        expect(page.locator("#new-token")).to_be_visible()
        check(f"profile page with a new token ({scheme})", strict=True)

        page.goto(base + "/api/docs/")
        expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
        check(f"API docs ({scheme})", ignore=("nested-interactive",))

    # At a phone's width: the sessions page, its menu open (API docs in it), and the dialog.
    page.set_viewport_size({"width": 390, "height": 844})
    for scheme in SCHEMES:
        page.emulate_media(color_scheme=scheme)
        page.goto(base + "/sessions/")
        expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")
        check(f"sessions page at 390 px ({scheme})", strict=True)
        page.click("#menu-toggle")
        expect(page.locator("#main-nav").get_by_role("link", name="API docs")).to_be_visible()
        check(f"sessions page at 390 px, menu open ({scheme})", strict=True)
        page.keyboard.press("Escape")
        expect(page.locator("#main-nav")).to_be_hidden()
        page.click("#start-session")
        expect(page.locator("#options-status")).to_have_text("")
        expect(page.locator("#launch-preview")).not_to_have_attribute("data-pending", "")
        expect(page.locator("#launch-preview")).not_to_have_attribute("aria-busy", "true")
        expect(page.locator("#preview-line")).not_to_be_empty()
        check(f"launch dialog at 390 px ({scheme})", strict=True)
        page.keyboard.press("Escape")
    page.set_viewport_size({"width": 1280, "height": 800})

    # The toggle outranks the system's theme (system → light → dark), on this page, the next one
    # and the admin, which reads the same choice; back to the system's at the end.
    page.emulate_media(color_scheme="light")
    page.goto(base + "/sessions/")
    expect(page.locator("html")).to_have_attribute("data-theme", "auto")
    page.click("#theme-toggle")
    page.click("#theme-toggle")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    expect(page.locator("#theme-toggle")).to_have_attribute("aria-label", "Theme: dark. Change theme")
    assert luminance(parse_rgb(page.evaluate("getComputedStyle(document.body).backgroundColor"))) < 0.05
    # No flash of the system's theme: the theme is in force when <body> first exists, before any of
    # the page is drawn (theme.js runs in <head>, before the parser reaches the body).
    page.add_init_script("""new MutationObserver((_, observer) => {
        if (!document.body) return;
        window.fgpuAtBody = [document.documentElement.dataset.theme, getComputedStyle(document.documentElement).colorScheme];
        observer.disconnect();
    }).observe(document, {childList: true, subtree: true});""")
    page.goto(base + "/account/")
    assert page.evaluate("window.fgpuAtBody") == ["dark", "dark"]
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    page.goto(base + "/admin/")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    page.goto(base + "/sessions/")
    page.click("#theme-toggle")
    expect(page.locator("html")).to_have_attribute("data-theme", "auto")
    assert page.evaluate("localStorage.getItem('theme')") == "auto"

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
    for scheme in SCHEMES:
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
