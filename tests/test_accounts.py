"""Named API tokens (create, show once, revoke, authenticate), the login token endpoint that
`fgpu login` uses (its tokens stored hashed), and login throttling on the login page, the token endpoint and the admin's
login — through the real URLconf and the one error shape."""
from __future__ import annotations

import hashlib
import io
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth import SESSION_KEY
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import services, throttle
from accounts.models import ApiToken, LoginToken
from accounts.selectors import api_token_digest, api_token_list_for
from tests.conftest import assert_error_shape

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-test-password"


@pytest.fixture(autouse=True)
def fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # hashing is not under test


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password=PASSWORD)


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", password=PASSWORD)


@pytest.fixture
def browser(alice) -> Client:
    client = Client()
    client.force_login(alice)
    return client


def with_token(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def create_on_page(client: Client, name: str):
    return client.post("/account/tokens/", {"name": name})


def shown_key(response) -> str:
    """The new token's key as the page shows it (the read-only field's value)."""
    html = response.content.decode()
    marker = 'id="new-token-value" class="token-value" value="'
    assert marker in html, "the page shows no new token"
    return html.split(marker, 1)[1].split('"', 1)[0]


# --- named tokens -----------------------------------------------------------------------------

def test_a_token_created_on_the_profile_page_is_shown_once_and_only_its_digest_is_stored(browser, alice):
    posted = create_on_page(browser, "ci-pipeline")
    # POST-redirect-GET: a reload of the page that shows the key re-posts nothing.
    assert posted.status_code == 303
    assert posted["Location"] == "/account/"
    response = browser.get(posted["Location"])

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    key = shown_key(response)
    assert "accounts.new_api_token" not in browser.session  # shown: the session no longer holds it
    token = ApiToken.objects.get(user=alice)
    assert token.name == "ci-pipeline"
    assert token.digest == hashlib.sha256(key.encode()).hexdigest()
    assert token.prefix == key[:8]
    stored = [str(v) for v in ApiToken.objects.values_list().get()]
    assert not any(key in value for value in stored)

    page = browser.get("/account/").content.decode()
    assert key not in page
    assert f"{token.prefix}…" in page
    assert "ci-pipeline" in page


def test_a_named_token_authenticates_api_requests_as_its_user(demo_cluster, alice, bob):
    key, _ = services.api_token_create(user=alice, name="laptop")

    response = with_token(key).post("/api/v1/sessions/", {"name": "s", "resources": {"cuda.shares": "0.5"}},
                                    format="json")

    assert response.status_code == 201, response.content
    assert response.json()["owner"] == "alice"
    assert with_token(key).get("/api/v1/sessions/").status_code == 200


def test_a_revoked_token_gets_401_in_the_error_shape(browser, alice):
    key, token = services.api_token_create(user=alice, name="ci")
    assert with_token(key).get("/api/v1/sessions/").status_code == 200

    response = browser.post(f"/account/tokens/{token.pk}/revoke/")

    assert response.status_code == 302 and response["Location"] == "/account/"
    token.refresh_from_db()
    assert token.revoked_at is not None
    body = assert_error_shape(with_token(key).get("/api/v1/sessions/"), 401)
    assert "revoked" in body["detail"]
    assert body["title"] == "Not authenticated"
    page = browser.get("/account/").content.decode()
    assert "was revoked" in page
    assert f'data-token-id="{token.pk}"' not in page


def test_revoking_a_token_twice_is_a_404_the_second_time(browser, alice):
    _, token = services.api_token_create(user=alice, name="ci")

    assert browser.post(f"/account/tokens/{token.pk}/revoke/").status_code == 302
    assert browser.post(f"/account/tokens/{token.pk}/revoke/").status_code == 404


def test_a_user_cannot_revoke_another_users_token(alice, bob):
    key, token = services.api_token_create(user=alice, name="ci")
    client = Client()
    client.force_login(bob)

    assert client.post(f"/account/tokens/{token.pk}/revoke/").status_code == 404

    token.refresh_from_db()
    assert token.revoked_at is None
    assert with_token(key).get("/api/v1/sessions/").status_code == 200


def test_the_profile_lists_only_the_users_own_live_tokens(browser, alice, bob):
    services.api_token_create(user=alice, name="mine")
    services.api_token_create(user=bob, name="bobs-token")
    _, revoked = services.api_token_create(user=alice, name="old")
    services.api_token_revoke(token=revoked)

    page = browser.get("/account/").content.decode()

    assert "mine" in page
    assert "bobs-token" not in page
    assert f'data-token-id="{revoked.pk}"' not in page


def test_a_token_name_is_unique_among_a_users_live_tokens_and_free_again_once_revoked(browser, alice, bob):
    _, first = services.api_token_create(user=alice, name="ci")

    response = create_on_page(browser, "ci")
    assert response.status_code == 400
    assert "already have a token named" in response.content.decode()
    assert ApiToken.objects.filter(user=alice).count() == 1

    services.api_token_create(user=bob, name="ci")  # another user's name space
    services.api_token_revoke(token=first)
    assert create_on_page(browser, "ci").status_code == 303
    assert ApiToken.objects.filter(user=alice, name="ci", revoked_at__isnull=True).count() == 1


def test_a_reload_after_creating_a_token_neither_creates_another_nor_shows_the_key_again(browser, alice):
    posted = create_on_page(browser, "laptop")
    first = browser.get(posted["Location"])
    key = shown_key(first)

    reloaded = browser.get("/account/")

    assert key not in reloaded.content.decode()
    assert 'id="new-token"' not in reloaded.content.decode()
    assert ApiToken.objects.filter(user=alice).count() == 1


def test_a_token_revoked_before_its_key_was_shown_is_not_shown(browser, alice):
    posted = create_on_page(browser, "laptop")
    services.api_token_revoke(token=ApiToken.objects.get(user=alice))

    page = browser.get(posted["Location"]).content.decode()

    assert 'id="new-token"' not in page


@pytest.mark.parametrize("name", ["", "   ", "x" * 65])
def test_a_blank_or_too_long_token_name_is_refused(browser, alice, name):
    response = create_on_page(browser, name)

    assert response.status_code == 400
    assert 'aria-invalid="true"' in response.content.decode()
    assert not ApiToken.objects.exists()


def test_last_used_is_recorded_at_most_once_a_minute(alice, monkeypatch):
    key, token = services.api_token_create(user=alice, name="ci")
    start = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: start)

    with_token(key).get("/api/v1/sessions/")
    token.refresh_from_db()
    assert token.last_used_at == start

    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(seconds=59))
    with_token(key).get("/api/v1/sessions/")
    token.refresh_from_db()
    assert token.last_used_at == start

    later = start + timedelta(seconds=61)
    monkeypatch.setattr(timezone, "now", lambda: later)
    with_token(key).get("/api/v1/sessions/")
    token.refresh_from_db()
    assert token.last_used_at == later


def test_an_inactive_users_token_gets_401(alice):
    key, _ = services.api_token_create(user=alice, name="ci")
    alice.is_active = False
    alice.save(update_fields=["is_active"])

    assert_error_shape(with_token(key).get("/api/v1/sessions/"), 401)


@pytest.mark.parametrize("header", ["Token not-a-real-token", "Token " + "0" * 40, "Token"])
def test_an_unknown_or_malformed_token_gets_401(db, header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)

    response = client.get("/api/v1/sessions/")

    assert_error_shape(response, 401)
    assert response["WWW-Authenticate"].startswith("Token")


# --- the password endpoint (`fgpu login`) ----------------------------------------------------------

@pytest.mark.parametrize("fmt", ["json", "multipart"])
def test_the_password_endpoint_issues_a_login_token_stored_only_as_its_digest(alice, fmt):
    client = APIClient()

    first = client.post("/api/v1/auth/token/", {"username": "alice", "password": PASSWORD}, format=fmt)
    again = client.post("/api/v1/auth/token/", {"username": "alice", "password": PASSWORD}, format=fmt)

    assert first.status_code == 200, first.content
    key, other = first.json()["token"], again.json()["token"]
    assert key != other  # a new key for every login; both work (two machines ran fgpu login)
    stored = list(LoginToken.objects.filter(user=alice))
    assert {t.digest for t in stored} == {api_token_digest(key), api_token_digest(other)}
    assert not any(key in str(value) for t in stored for value in vars(t).values())  # no plaintext anywhere
    assert with_token(key).get("/api/v1/sessions/").status_code == 200
    assert with_token(other).get("/api/v1/sessions/").status_code == 200


def test_a_user_keeps_the_newest_login_tokens_only(alice):
    keys = [services.login_token_issue(user=alice) for _ in range(services.LOGIN_TOKENS_KEPT + 1)]

    assert LoginToken.objects.filter(user=alice).count() == services.LOGIN_TOKENS_KEPT
    assert_error_shape(with_token(keys[0]).get("/api/v1/sessions/"), 401)  # the oldest is gone
    assert with_token(keys[-1]).get("/api/v1/sessions/").status_code == 200


def test_login_tokens_are_not_listed_with_the_named_tokens_and_may_share_a_name(alice):
    services.login_token_issue(user=alice)
    services.login_token_issue(user=alice)
    key, _ = services.api_token_create(user=alice, name="fgpu login")  # a named token may be called so too

    assert [t.kind for t in api_token_list_for(user=alice)] == ["named"]
    assert with_token(key).get("/api/v1/sessions/").status_code == 200


def test_a_plaintext_login_token_of_before_is_hashed_by_the_migration_and_keeps_working(alice):
    import importlib

    from django.apps import apps
    from rest_framework.authtoken.models import Token

    key = Token.objects.create(user=alice).key  # as DRF's authtoken stored it, in plaintext
    migration = importlib.import_module("accounts.migrations.0003_login_tokens_hashed")

    migration.hash_login_tokens(apps, None)

    assert not Token.objects.exists()
    assert LoginToken.objects.get(user=alice).digest == api_token_digest(key)
    assert with_token(key).get("/api/v1/sessions/").status_code == 200


def test_the_login_token_shows_on_the_profile_and_revoking_it_ends_it(browser, alice):
    key = APIClient().post("/api/v1/auth/token/", {"username": "alice", "password": PASSWORD},
                           format="json").json()["token"]
    page = browser.get("/account/").content.decode()
    assert "fgpu login" in page
    assert f"{key[:8]}…" in page
    assert key not in page

    assert browser.post("/account/login-token/revoke/").status_code == 302

    assert not LoginToken.objects.filter(user=alice).exists()
    assert_error_shape(with_token(key).get("/api/v1/sessions/"), 401)
    fresh = APIClient().post("/api/v1/auth/token/", {"username": "alice", "password": PASSWORD},
                             format="json").json()["token"]
    assert fresh != key


def test_the_profile_page_shows_who_is_signed_in(browser, alice):
    alice.first_name, alice.last_name, alice.email = "Alice", "Liddell", "alice@example.com"
    alice.save()

    response = browser.get("/account/")

    page = response.content.decode()
    assert response.status_code == 200
    assert "Alice Liddell" in page
    assert "alice@example.com" in page
    assert 'id="account-role">User<' in page
    assert 'id="profile-link"' in page  # the user menu links here


# --- login throttling ---------------------------------------------------------------------------

def fail_token_logins(username: str, times: int = throttle.LIMIT, *, ip: str = "127.0.0.1"):
    for _ in range(times):
        response = APIClient().post("/api/v1/auth/token/", {"username": username, "password": "wrong"},
                                    format="json", REMOTE_ADDR=ip)
        assert response.status_code == 400, response.content


def token_login(username: str, *, ip: str = "127.0.0.1", password: str = PASSWORD):
    return APIClient().post("/api/v1/auth/token/", {"username": username, "password": password},
                            format="json", REMOTE_ADDR=ip)


@pytest.fixture
def clock(monkeypatch):
    """The throttle's clock, frozen; `clock.advance(seconds)` moves it."""

    class Clock:
        now = 1_800_000_000.0

        def advance(self, seconds: float) -> None:
            self.now += seconds

    frozen = Clock()
    monkeypatch.setattr(throttle, "_clock", lambda: frozen.now)
    return frozen


def test_after_five_failed_logins_the_token_endpoint_answers_429_even_for_the_right_password(alice, clock):
    fail_token_logins("alice")

    response = token_login("alice")

    body = assert_error_shape(response, 429)
    assert body == {"type": "too-many-attempts", "title": "Too many requests",
                    "detail": "Too many attempts, try again in 15 minutes.", "field_errors": {}}
    assert response["Retry-After"] == "900"
    assert not LoginToken.objects.exists()


def test_four_failed_logins_do_not_lock_anyone_out(alice, clock):
    fail_token_logins("alice", throttle.LIMIT - 1)

    assert token_login("alice").status_code == 200


def test_the_lockout_ends_when_the_fifteen_minute_window_does(alice, clock):
    fail_token_logins("alice")
    clock.advance(10 * 60 + 30)
    assert token_login("alice").json()["detail"] == "Too many attempts, try again in 5 minutes."
    clock.advance(4 * 60)
    assert token_login("alice").json()["detail"] == "Too many attempts, try again in 1 minute."

    clock.advance(30)

    assert token_login("alice").status_code == 200


def test_five_failures_for_one_username_from_one_address_leave_other_usernames_from_it_alone(alice, bob, clock):
    """Five bad passwords for a user that does not exist once locked every user behind the same
    address out (issue 18): the lock is per (username, address)."""
    fail_token_logins("mallory", ip="203.0.113.7")

    assert_error_shape(token_login("mallory", ip="203.0.113.7"), 429)
    assert token_login("bob", ip="203.0.113.7").status_code == 200


def test_five_failures_for_one_username_lock_it_from_that_address_only(alice, clock):
    fail_token_logins("alice", ip="203.0.113.1")

    assert_error_shape(token_login("alice", ip="203.0.113.1"), 429)
    assert token_login("alice", ip="198.51.100.1").status_code == 200


def test_an_address_that_walks_through_usernames_is_locked_at_its_ceiling(alice, bob, clock):
    for i in range(throttle.ADDRESS_LIMIT):
        fail_token_logins(f"guess-{i}", 1, ip="203.0.113.9")

    assert_error_shape(token_login("bob", ip="203.0.113.9"), 429)
    assert token_login("bob", ip="198.51.100.1").status_code == 200


def test_a_successful_login_clears_its_own_failures(alice, clock):
    fail_token_logins("alice", throttle.LIMIT - 1, ip="203.0.113.1")
    assert token_login("alice", ip="203.0.113.1").status_code == 200

    fail_token_logins("alice", throttle.LIMIT - 1, ip="203.0.113.1")

    assert token_login("alice", ip="203.0.113.1").status_code == 200


def test_a_successful_login_does_not_clear_its_addresss_failures(alice, bob, clock):
    """A good login clears its (username, address) count only: were the address's count cleared too,
    a guesser walking through usernames would reset its ceiling with an account of its own."""
    for i in range(throttle.ADDRESS_LIMIT - 1):
        fail_token_logins(f"guess-{i}", 1, ip="203.0.113.9")
    assert token_login("alice", ip="203.0.113.9").status_code == 200

    fail_token_logins("guess-last", 1, ip="203.0.113.9")

    assert_error_shape(token_login("bob", ip="203.0.113.9"), 429)
    assert_error_shape(token_login("alice", ip="203.0.113.9"), 429)
    assert token_login("bob", ip="198.51.100.1").status_code == 200


def test_an_administrator_unlocks_a_user_in_the_admin_and_an_address_with_login_unlock(alice, bob, django_user_model,
                                                                                     clock):
    from django.core.management import call_command

    fail_token_logins("alice", ip="203.0.113.1")
    fail_token_logins("alice", ip="203.0.113.2")
    root = django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    client = Client()
    client.force_login(root)
    response = client.post("/admin/auth/user/", {"action": "clear_failed_logins", "_selected_action": [alice.pk]},
                           follow=True)
    assert "Cleared the failed logins of alice" in response.content.decode()
    assert token_login("alice", ip="203.0.113.1").status_code == 200
    assert token_login("alice", ip="203.0.113.2").status_code == 200

    for i in range(throttle.ADDRESS_LIMIT):
        fail_token_logins(f"guess-{i}", 1, ip="203.0.113.9")
    assert_error_shape(token_login("bob", ip="203.0.113.9"), 429)
    call_command("login_unlock", "--address", "203.0.113.9", stdout=io.StringIO())
    assert token_login("bob", ip="203.0.113.9").status_code == 200


def test_the_login_page_shows_too_many_attempts_and_does_not_sign_in(alice, clock):
    client = Client()
    for _ in range(throttle.LIMIT):
        response = client.post("/login/", {"username": "alice", "password": "wrong"})
        assert response.status_code == 200
        assert "correct username and password" in response.content.decode()

    response = client.post("/login/", {"username": "alice", "password": PASSWORD})

    assert response.status_code == 429
    page = response.content.decode()
    assert "Too many attempts, try again in 15 minutes." in page
    assert 'value="alice"' in page  # the form keeps the username
    assert SESSION_KEY not in client.session
    clock.advance(throttle.WINDOW)
    assert client.post("/login/", {"username": "alice", "password": PASSWORD}).status_code == 302


def test_failures_on_the_login_page_and_the_token_endpoint_count_together(alice, clock):
    client = Client()
    for _ in range(3):
        client.post("/login/", {"username": "alice", "password": "wrong"})
    fail_token_logins("alice", 2)

    assert_error_shape(token_login("alice"), 429)
    assert client.post("/login/", {"username": "alice", "password": PASSWORD}).status_code == 429


def test_the_admins_login_page_is_throttled_too(django_user_model, clock):
    django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    client = Client()
    for _ in range(throttle.LIMIT):
        client.post("/admin/login/", {"username": "root", "password": "wrong"})

    response = client.post("/admin/login/?next=/admin/", {"username": "root", "password": PASSWORD})

    assert response.status_code == 200  # the admin's own form error; no way in
    assert SESSION_KEY not in client.session
    assert_error_shape(token_login("root"), 429)


def test_with_redis_the_counters_live_in_the_shared_cache_every_web_process_reads(settings):
    """The in-process tests get a private cache (tests/conftest.py); this one uses the configured
    one: Redis when REDIS_URL is set, as the web processes do."""
    from django.core.cache import cache

    import console.settings as project

    if not project.REDIS_URL:
        pytest.skip("REDIS_URL is not set")
    settings.CACHES = project.CACHES
    assert settings.CACHES["default"]["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    username, ip = f"user-{uuid.uuid4().hex}", f"2001:db8::{uuid.uuid4().hex[:4]}:{uuid.uuid4().hex[:4]}"
    try:
        for _ in range(throttle.LIMIT):
            throttle.login_failure_record(username=username, ip=ip)
        settings.CACHES = dict(project.CACHES)  # a fresh connection, as another process would have
        assert throttle.login_blocked_for(username=username, ip=ip) > throttle.WINDOW - 60
        assert throttle.login_blocked_for(username=f"{username}-other", ip=ip) == 0
    finally:
        for key, _ in throttle._subjects(username=username, ip=ip):
            cache.delete_many([key + ":start", key + ":count"])


def test_administrators_list_and_revoke_tokens_in_the_admin_but_never_see_or_add_keys(alice, django_user_model):
    key, token = services.api_token_create(user=alice, name="ci")
    root = django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    client = Client()
    client.force_login(root)

    listing = client.get("/admin/accounts/apitoken/")
    detail = client.get(f"/admin/accounts/apitoken/{token.pk}/change/")
    revoked = client.post("/admin/accounts/apitoken/", {"action": "revoke", "_selected_action": [str(token.pk)]})

    assert listing.status_code == 200 and "ci" in listing.content.decode()
    assert detail.status_code == 200
    assert token.digest not in detail.content.decode() and key not in detail.content.decode()
    assert client.get("/admin/accounts/apitoken/add/").status_code == 403
    assert revoked.status_code == 302
    assert_error_shape(with_token(key).get("/api/v1/sessions/"), 401)
