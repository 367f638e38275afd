"""The console pages' shared parts, as the server renders them (issue 36.6): the theme script in
<head> without defer (the theme set before the first paint), the theme toggle, the SVG favicon, the
phone menu that keeps API docs, Swagger UI's way back to the console, the empty sessions list's own
launch button and the Files panel's words. How they look and read in the light and dark themes is
tests/test_browser_contrast.py's (axe in Chromium)."""

from __future__ import annotations

import re

import pytest
from django.contrib.staticfiles import finders
from django.test import Client

pytestmark = pytest.mark.django_db


def page_as(user, path: str) -> str:
    client = Client()
    if user is not None:
        client.force_login(user)
    response = client.get(path)
    assert response.status_code == 200, (path, response.status_code)
    return response.content.decode()


def test_every_page_sets_its_theme_before_the_first_paint_and_offers_the_toggle(alice, demo_cluster):
    for html in (page_as(None, "/login/"), page_as(alice, "/sessions/"), page_as(alice, "/account/")):
        head = html.split("</head>", 1)[0]
        assert '<meta name="color-scheme" content="light dark">' in head
        script = re.search(r'<script src="/static/js/theme\.js"([^>]*)>', head)
        assert script, "theme.js is not in <head>"
        assert "defer" not in script.group(1) and "async" not in script.group(1)
        assert head.index('href="/static/css/console.css"') < script.start()  # its colours are there to pick
        assert 'id="theme-toggle"' in html


def test_the_favicon_is_an_svg_file_that_the_console_the_admin_and_the_api_docs_link(alice, admin, demo_cluster):
    favicon = finders.find("favicon.svg")
    assert favicon and open(favicon).read().startswith("<svg")
    link = '<link rel="icon" type="image/svg+xml" href="/static/favicon.svg">'
    assert link in page_as(None, "/login/")
    assert link in page_as(admin, "/admin/")
    assert 'href="/static/favicon.svg"' in page_as(alice, "/api/docs/")


def test_the_api_docs_page_leads_back_to_the_console(alice):
    html = page_as(alice, "/api/docs/")

    bar = html.split('<header class="docs-bar">', 1)[1].split("</header>", 1)[0]
    assert 'href="/sessions/"' in bar and "fGPU Console" in bar
    assert 'href="/account/"' in bar  # API tokens: what a reader of the API docs needs next
    assert 'href="/admin/"' not in bar  # not an administrator
    assert 'id="swagger-ui"' in html


def test_the_phone_menu_holds_every_main_link_api_docs_included(alice, demo_cluster):
    html = page_as(alice, "/sessions/")

    assert re.search(r'<button[^>]*id="menu-toggle"[^>]*aria-expanded="false" aria-controls="main-nav"', html)
    nav = html.split('id="main-nav"', 1)[1].split("</nav>", 1)[0]
    assert ">Sessions</a>" in nav and 'href="/api/docs/">API docs</a>' in nav


def test_an_empty_sessions_list_has_its_own_launch_button(alice, demo_cluster):
    html = page_as(alice, "/sessions/")

    empty = html.split('id="sessions-empty"', 1)[1].split('id="pager"', 1)[0]
    assert "No sessions yet" in empty
    assert re.search(r'<button type="button" class="button button-primary empty-action" id="empty-start-session" '
                     r'data-click="start-session"', empty)


def test_the_files_panel_says_what_projects_and_shared_hold(alices_session, alice):
    html = page_as(alice, f"/sessions/{alices_session.id}/terminal/")

    assert "<code>projects/</code>: your projects' data folders;" in html
    assert "<code>shared/</code>: folders shared with you" in html
    assert "your projects')" not in html
