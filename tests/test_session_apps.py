"""Session apps in process (issue 16): what an image may declare, the API that declares and shows
them, and the proxy's pure parts (paths that try to leave the prefix, the headers sent upstream,
the token mask). The whole path, with a real app, is in tests/test_session_apps_e2e.py."""
from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError

from sessions.serving.proxy import TokenMask, path_escapes, upstream_headers, upstream_path, PATH_RE
from sessions.models import SessionImage, validate_image_apps
from sessions.serving.session_apps import app_open_message, app_token_new, jupyter_app, session_app_links
from tests.conftest import client_for

JUPYTER = jupyter_app(python="python3")


def test_an_image_may_declare_jupyter_and_small_apps():
    validate_image_apps([JUPYTER, {"name": "tensorboard", "command": "tensorboard --port {port}", "port": 6006}])
    validate_image_apps([])


@pytest.mark.parametrize("apps, words", [
    ({"name": "x"}, "a list of at most 16 apps"),
    ([{"name": "terminal", "command": "x", "port": 1}], "the terminal is built in"),
    ([{"name": "a", "command": "x", "port": 1}, {"name": "a", "command": "y", "port": 2}], "each name once"),
    ([{"name": "Jupyter", "command": "x", "port": 1}], "lower-case letters"),
    ([{"name": "a", "command": "", "port": 1}], "command: one shell command line"),
    ([{"name": "a", "command": "x\x00", "port": 1}], "command: one shell command line"),
    ([{"name": "a", "command": "x", "port": 70000}], "port: a whole number from 1 to 65535"),
    ([{"name": "a", "command": "x", "port": True}], "port: a whole number"),
    ([{"name": "a", "command": "x", "port": 1, "protocol": "tcp"}], "protocol: http"),
    ([{"name": "a", "command": "x", "port": 1, "path": "../admin/"}], 'path: a relative path'),
    ([{"name": "a", "command": "x", "port": 1, "path": "/lab"}], 'path: a relative path'),
    ([{"name": "a", "command": "x", "port": 1, "timeout": 0}], "timeout: seconds from 1 to 600"),
    ([{"name": "a", "command": "x", "port": 1, "icon": "x.png"}], "unknown field(s) icon"),
    ([{"name": "a", "command": "x", "port": 1, "title": "a\x1b[31m"}], "title: text of at most 64"),
])
def test_malformed_apps_are_refused_naming_the_field(apps, words):
    with pytest.raises(ValidationError) as refused:
        validate_image_apps(apps)
    assert words in str(refused.value)


@pytest.mark.django_db
def test_administrators_declare_apps_through_the_api_and_sessions_show_them_without_the_token(demo_cluster, staff,
                                                                                              alice):
    host = SessionImage.objects.get(reference="host")
    client = client_for(staff)
    tag = client.get(f"/api/v1/images/{host.pk}/")["ETag"]
    changed = client.patch(f"/api/v1/images/{host.pk}/", {"apps": [JUPYTER]}, format="json", HTTP_IF_MATCH=tag)
    assert changed.status_code == 200, changed.content
    assert changed.json()["apps"] == [JUPYTER]
    tag = changed["ETag"]
    refused = client.patch(f"/api/v1/images/{host.pk}/", {"apps": [{**JUPYTER, "port": 0}]}, format="json",
                           HTTP_IF_MATCH=tag)
    assert refused.status_code == 400
    assert "port: a whole number from 1 to 65535" in str(refused.json()["field_errors"]["apps"])
    assert client_for(alice).patch(f"/api/v1/images/{host.pk}/", {"apps": []}, format="json",
                                   HTTP_IF_MATCH="*").status_code == 403

    launched = client_for(alice).post("/api/v1/sessions/", {"name": "nb", "resources": {"cuda.shares": "0.5"}}, format="json")
    assert launched.status_code == 201, launched.content
    session_id = launched.json()["id"]
    assert launched.json()["apps"] == [{"name": "jupyter", "title": "JupyterLab",
                                        "url": f"/sessions/{session_id}/open/jupyter/"}]
    assert "token" not in json.dumps(launched.json()["apps"])
    assert client_for(alice).get("/api/v1/images/").json()["results"][0]["apps"] == [JUPYTER]


@pytest.mark.django_db
def test_a_session_from_before_images_has_no_apps(alice):
    from sessions.models import ComputeSession

    session = ComputeSession.objects.create(name="old", owner=alice, resources={})
    assert session_app_links(session) == []


def test_app_tokens_are_random_not_derived_from_the_secret_key(settings):
    import hashlib
    import hmac

    tokens = {app_token_new() for _ in range(100)}
    assert len(tokens) == 100 and all(len(t) == 48 and int(t, 16) >= 0 for t in tokens)
    derived = hmac.new(settings.SECRET_KEY.encode(), b"fgpu-app:11111111-1111-1111-1111-111111111111:jupyter",
                       hashlib.sha256).hexdigest()[:48]
    assert derived not in tokens


@pytest.mark.django_db
def test_the_open_message_carries_a_new_token_and_the_one_to_keep(alices_session):
    from sessions.serving.session_apps import session_app_get

    image = alices_session.image
    image.apps = [JUPYTER]
    image.save(update_fields=["apps"])
    app = session_app_get(session=alices_session, name="jupyter")
    message = app_open_message(session=alices_session, app=app, token="a" * 48, keep=None)
    assert (message["token"], message["keep"]) == ("a" * 48, "")
    assert app_open_message(session=alices_session, app=app, token="b" * 48, keep="a" * 48)["keep"] == "a" * 48


SESSION = "0b0e2f3c-1d2e-4f5a-8b9c-0d1e2f3a4b5c"


def scope(path: str, raw: bytes | None = None, headers=(), query=b"") -> dict:
    return {"type": "http", "path": path, "raw_path": raw if raw is not None else path.encode(),
            "headers": list(headers), "query_string": query, "scheme": "http", "client": ("10.0.0.9", 5000)}


@pytest.mark.parametrize("raw", [
    b"/../../terminal/", b"/%2e%2e/%2e%2e/terminal/", b"/%2E%2E/x", b"/..%2f..%2fterminal/", b"/a/./b",
    b"/a%5c..%5cb", b"/a\\..\\b", b"/a%00b", b"/a/%2e/b",
])
def test_paths_that_try_to_leave_the_prefix_are_refused(raw):
    prefix = f"/sessions/{SESSION}/apps/jupyter".encode()
    decoded = (prefix + raw).decode().replace("%2e", ".").replace("%2E", ".").replace("%2f", "/")
    assert path_escapes(scope(decoded, raw=prefix + raw))


@pytest.mark.parametrize("path", ["/lab", "/lab/tree/a%20b.ipynb", "/api/kernels/x/channels", "/static/a.b.js", "/"])
def test_ordinary_paths_pass(path):
    full = f"/sessions/{SESSION}/apps/jupyter{path}"
    assert not path_escapes(scope(full))
    assert PATH_RE.match(full)


def test_the_app_gets_its_token_and_the_browsers_cookies_but_not_the_consoles():
    headers = upstream_headers(scope("/x", headers=[
        (b"host", b"console.example:8443"), (b"cookie", b"sessionid=s3cret; _xsrf=abc; csrftoken=t0k; fgpu_app=grant"),
        (b"authorization", b"Token user-api-key"), (b"accept-encoding", b"gzip"), (b"connection", b"keep-alive"),
        (b"sec-websocket-key", b"k"), (b"x-custom", b"kept")]), token="the-token")
    assert dict(headers) == {"cookie": "_xsrf=abc", "authorization": "token the-token", "accept-encoding": "identity",
                             "x-custom": "kept", "host": "console.example:8443",
                             "x-forwarded-host": "console.example:8443", "x-forwarded-proto": "http",
                             "x-forwarded-for": "10.0.0.9"}


def test_the_masked_token_in_a_query_is_made_the_real_one_again():
    token = "a" * 48
    match = PATH_RE.match(f"/sessions/{SESSION}/apps/jupyter/api/kernels/k/channels")
    app = {"base_url": True}
    path = upstream_path(scope(match.string, query=b"session_id=1&token=" + b"%2A" * 48), match, app, token=token)
    assert path.endswith("?session_id=1&token=" + token)
    plain = upstream_path(scope(match.string), match, {"base_url": False}, token=token)
    assert plain == "/api/kernels/k/channels"


def test_the_token_mask_replaces_the_token_across_chunks_and_holds_back_only_a_possible_start():
    token = "0123456789abcdef" * 3
    mask = TokenMask(token)
    page = f'<script>{{"token": "{token}", "x": 1}}</script>'.encode()
    out = b"".join(mask.feed(page[i:i + 7]) for i in range(0, len(page), 7)) + mask.flush()
    assert out == page.replace(token.encode(), b"*" * 48) and len(out) == len(page)
    streaming = TokenMask(token)
    assert streaming.feed(b"first\n") == b"first\n"  # nothing like the token's start: passed on at once
    assert streaming.feed(b"then 0123") == b"then "  # may be the token's start: held
    assert streaming.feed(b"4 no") == b"01234 no"
    assert streaming.flush() == b""


def test_text_postgresql_cannot_store_is_refused():
    with pytest.raises(ValidationError, match="command: one shell command line"):
        validate_image_apps([{"name": "a", "command": "x\ud800", "port": 1}])
    with pytest.raises(ValidationError, match="title: text of at most 64"):
        validate_image_apps([{"name": "a", "command": "x", "port": 1, "title": "\udfff"}])


@pytest.mark.parametrize("method, headers, refused", [
    ("POST", [(b"host", b"console:8000"), (b"origin", b"http://console:8000")], False),
    ("POST", [(b"host", b"console:8000")], False),  # not a browser
    ("POST", [(b"host", b"console:8000"), (b"origin", b"https://evil.example")], True),
    ("PUT", [(b"host", b"console:8000"), (b"origin", b"null")], True),
    ("DELETE", [(b"host", b"console:8000"), (b"sec-fetch-site", b"cross-site")], True),
    ("GET", [(b"host", b"console:8000"), (b"origin", b"https://evil.example")], False),
])
def test_requests_that_change_something_from_another_site_are_refused(method, headers, refused):
    from sessions.serving.proxy import cross_site

    assert cross_site({**scope("/x", headers=headers), "method": method}) is refused


@pytest.mark.django_db
def test_the_admins_image_page_declares_apps_and_refuses_malformed_ones(admin):
    from django.test import Client

    host = SessionImage.objects.get(reference="host")
    browser = Client()
    browser.force_login(admin)
    url = f"/admin/compute_sessions/sessionimage/{host.pk}/change/"
    page = browser.get(url)
    assert page.status_code == 200 and 'name="apps"' in page.content.decode()
    form = {"reference": "host", "display_name": "", "description": "", "accelerators": "[]", "shell": "",
            "labels": "{}", "is_default": "on"}
    refused = browser.post(url, {**form, "apps": '[{"name": "terminal", "command": "x", "port": 1}]'})
    assert refused.status_code == 200 and "the terminal is built in" in refused.content.decode()
    saved = browser.post(url, {**form, "apps": json.dumps([JUPYTER])})
    assert saved.status_code == 302, saved.content.decode()[:2000]
    host.refresh_from_db()
    assert host.apps == [JUPYTER]
