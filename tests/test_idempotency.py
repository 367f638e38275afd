"""`Idempotency-Key` on POST /api/v1/sessions/ (sessions.admission.idempotency): a repeated key replays
the first answer and makes no second session, also when the repeats race on real PostgreSQL;
a key reused for another body, or a malformed key, is refused in the error shape."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from sessions.admission.idempotency import KEY_TTL
from sessions.models import ComputeSession, IdempotencyKey, Quota
from tests.conftest import assert_error_shape, client_for, wait_until

BODY = {"name": "notebook", "resources": {"cuda.shares": "0.5"}}
KEY = "6f1c1f0e-2a8e-4a55-9d1e-3b0e7c2d9a41"


def launch(client, body=None, key: str | None = KEY):
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return client.post("/api/v1/sessions/", body or BODY, format="json", **headers)


# --- one request after another --------------------------------------------------------------------

@pytest.mark.django_db
def test_a_repeated_key_replays_the_first_answer_and_makes_no_second_session(demo_cluster, alice):
    api = client_for(alice)
    first = launch(api)
    ComputeSession.objects.update(status="RUNNING")  # the session moved on meanwhile

    again = launch(api, {"resources": {"cuda.shares": "0.5"}, "name": "notebook"})  # same body, keys reordered

    assert first.status_code == again.status_code == 201, again.content
    assert again.json() == first.json() and first.json()["status"] == "PENDING"  # the first answer, as it was
    assert again["Idempotent-Replayed"] == "true" and not first.has_header("Idempotent-Replayed")
    assert ComputeSession.objects.count() == 1
    assert IdempotencyKey.objects.get().session_id == ComputeSession.objects.get().pk


@pytest.mark.django_db
def test_launches_without_a_key_or_with_different_keys_each_make_a_session(demo_cluster, alice):
    api = client_for(alice)

    bodies = [{**BODY, "name": f"notebook-{i}"} for i in range(4)]  # a user's live sessions have distinct names
    answers = [launch(api, bodies[0], key=None), launch(api, bodies[1], key=None), launch(api, bodies[2], key="a"),
               launch(api, bodies[3], key="b")]

    assert [a.status_code for a in answers] == [201] * 4
    assert len({a.json()["id"] for a in answers}) == 4 == ComputeSession.objects.count()


@pytest.mark.django_db
def test_a_key_reused_with_another_body_is_a_422_naming_the_header(demo_cluster, alice):
    api = client_for(alice)
    launch(api)

    body = assert_error_shape(launch(api, {"name": "other", "resources": {"cuda.shares": "0.25"}}), 422)

    assert body["type"] == "idempotency-key-reused" and list(body["field_errors"]) == ["Idempotency-Key"]
    assert ComputeSession.objects.count() == 1


@pytest.mark.django_db
def test_keys_are_per_user(demo_cluster, alice, bob):
    mine = launch(client_for(alice))
    theirs = launch(client_for(bob), {"name": "bobs", "resources": {"cuda.shares": "1"}})

    assert mine.status_code == theirs.status_code == 201
    assert theirs.json()["owner"] == "bob" and theirs.json()["id"] != mine.json()["id"]
    assert ComputeSession.objects.count() == 2


@pytest.mark.django_db
def test_a_refused_launch_keeps_nothing_and_the_key_may_be_sent_again(demo_cluster, alice):
    api = client_for(alice)

    refused = assert_error_shape(launch(api, {"resources": {"cuda.shares": "0.3"}}), 400)  # off the 0.25 quantum
    created = launch(api)

    assert refused["type"] == "invalid-resources"
    assert created.status_code == 201 and ComputeSession.objects.count() == 1


@pytest.mark.parametrize("key, problem", [
    ("", "must not be empty"),
    ("k" * 256, "at most 255 characters"),
    ("ключ", "printable ASCII"),
    ("tab\there", "printable ASCII"),
])
@pytest.mark.django_db
def test_a_malformed_key_is_a_400_naming_the_header_and_creates_nothing(demo_cluster, alice, key, problem):
    body = assert_error_shape(launch(client_for(alice), key=key), 400)

    assert body["type"] == "invalid-idempotency-key"
    assert problem in body["field_errors"]["Idempotency-Key"][0]
    assert not ComputeSession.objects.exists() and not IdempotencyKey.objects.exists()


@pytest.mark.django_db
def test_the_longest_key_of_printable_ascii_is_accepted(demo_cluster, alice):
    key = ("~ !" * 100)[:255]

    assert [launch(client_for(alice), key=key).status_code for _ in range(2)] == [201, 201]
    assert ComputeSession.objects.count() == 1


@pytest.mark.django_db
def test_a_key_older_than_a_day_is_forgotten_and_expired_keys_are_swept(demo_cluster, alice, bob):
    api = client_for(alice)
    first = launch(api)
    launch(client_for(bob), key="bobs-old-key")
    IdempotencyKey.objects.update(created_at=timezone.now() - KEY_TTL - timedelta(minutes=1))
    ComputeSession.objects.filter(pk=first.json()["id"]).update(status="CANCELLED")  # its name is free again

    again = launch(api)

    assert again.status_code == 201 and again.json()["id"] != first.json()["id"]
    assert not again.has_header("Idempotent-Replayed")
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == [KEY]  # bob's expired key swept too
    assert ComputeSession.objects.count() == 3


def test_the_schema_documents_the_header_and_the_422():
    from tests.test_openapi import SCHEMA as schema  # as /api/schema/ served it (built once a run)

    operation = schema["paths"]["/api/v1/sessions/"]["post"]

    [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["in"] == "header" and not header.get("required") and header["schema"]["maxLength"] == 255
    assert operation["responses"]["422"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    assert "Idempotency-Key" in operation["description"]


# --- racing requests on PostgreSQL ------------------------------------------------------------------

def race(clients_and_bodies, *, hold_quota_of) -> list:
    """Send the launches at once, each from its own thread and database connection, while the
    test holds `hold_quota_of`'s quota row locked: every launch then waits inside its
    transaction (the first one holding the key on the quota lock, the others on the first one's
    key row), so they truly overlap. Released once all are seen waiting on a lock in
    pg_stat_activity. Returns the responses in order."""
    answers: list = [None] * len(clients_and_bodies)
    errors: list[BaseException] = []

    def work(i, client, body):
        try:
            answers[i] = launch(client, body)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(i, client, body), name=f"launch-{i}")
               for i, (client, body) in enumerate(clients_and_bodies)]
    with transaction.atomic():
        Quota.objects.select_for_update().get(user=hold_quota_of)
        for thread in threads:
            thread.start()

        def all_waiting():
            assert not errors, errors
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_stat_clear_snapshot()")  # a transaction otherwise sees one snapshot
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
                return cursor.fetchone()[0] == len(threads)

        wait_until(all_waiting, timeout=60, what="every launch to wait on a lock")
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a launch is stuck (deadlock?)"
    assert not errors, errors
    return answers


@pytest.mark.django_db(transaction=True)
def test_racing_requests_with_one_key_make_one_session_and_all_get_its_answer(demo_cluster, alice):
    assert connection.vendor == "postgresql"
    Quota.objects.create(user=alice, max_sessions=10)
    clients = [client_for(alice) for _ in range(6)]

    answers = race([(client, BODY) for client in clients], hold_quota_of=alice)

    assert [a.status_code for a in answers] == [201] * 6, [a.content for a in answers]
    assert len({a.content for a in answers}) == 1  # the same body, byte for byte
    assert sorted(a.has_header("Idempotent-Replayed") for a in answers) == [False] + [True] * 5
    assert ComputeSession.objects.count() == 1 and IdempotencyKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_racing_requests_with_one_key_and_different_bodies_make_one_session_and_refuse_the_others(demo_cluster,
                                                                                                  alice):
    Quota.objects.create(user=alice, max_sessions=10)
    bodies = [{"name": f"s{i}", "resources": {"cuda.shares": "0.25"}} for i in range(4)]

    answers = race([(client_for(alice), body) for body in bodies], hold_quota_of=alice)

    assert sorted(a.status_code for a in answers) == [201, 422, 422, 422]
    [made] = [a.json() for a in answers if a.status_code == 201]
    assert list(ComputeSession.objects.values_list("name", flat=True)) == [made["name"]]
