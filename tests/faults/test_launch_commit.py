"""A launch's answer is the one its commit earned (issue 33.1): with the database's backends
terminated again and again while launches go on through the real ASGI server (uvicorn), a launch
answers 201 (its session committed) or 503 (nothing committed), never another 5xx; every 201
names one session, of its name; every 503 left no session behind. Half the launches carry an
`Idempotency-Key` (the key's row is written in the session's transaction), half do not; none is
retried, so a session without its 201 would show as a name with a session and no 201.

Before this, the notice's re-read after the commit (sessions/lifecycle/events.py) raised through the
launch: 500 answers for sessions that ran, and sessions created without their 201."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.stack import Proc, database_url_default, free_port, wait_until, web_answers, web_command

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

KILL_EVERY_S = 0.2  # as the fault probe: every backend of the test database, five times a second
CLIENTS = 4
ENOUGH_CUT, ENOUGH_CREATED, DEADLINE_S = 5, 20, 90


def terminate_backends(database_url: str) -> int:
    """pg_terminate_backend every other connection to the database of `database_url`."""
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = %s AND pid <> pg_backend_pid()", [name]).fetchall()
    return sum(1 for (done,) in rows if done)


class Killer(threading.Thread):
    def __init__(self, database_url: str):
        super().__init__(daemon=True)
        self.database_url, self.stop, self.killed = database_url, threading.Event(), 0

    def run(self):
        while not self.stop.wait(KILL_EVERY_S):
            self.killed += terminate_backends(self.database_url)


def launch(base: str, token: str, name: str, keyed: bool) -> tuple[int, dict]:
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    if keyed:
        headers["Idempotency-Key"] = name
    body = json.dumps({"name": name, "resources": {"cuda.shares": "0.25"}}).encode()
    request = urllib.request.Request(base + "/api/v1/sessions/", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw[:300].decode(errors="replace")}
    except OSError as exc:
        return 0, {"error": str(exc)}


def fresh_connections() -> None:
    """This process's database connection and its pool's idle ones were terminated with the rest:
    replace them, so the test and its teardown read afresh."""
    from django.db import connection

    connection.close()
    connection.pool.check()


@pytest.fixture
def web(demo_cluster, tmp_path, request):
    """uvicorn on the test database, with Redis database 6's broker (a scheduler pass is only
    asked for: no worker runs)."""
    import os

    from django.conf import settings

    env = {**os.environ, "DATABASE_URL": database_url_default(), "FGPU_DATA_DIR": str(tmp_path / "data"),
           "PYTHONUNBUFFERED": "1", "REDIS_URL": settings.REDIS_URL}
    env.pop("FGPU_CELERY_EAGER", None)
    port = free_port()
    proc = Proc("web", web_command(port), env=env, log_dir=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: web_answers(base), timeout=60, what="the web process to answer")
        yield base
    finally:
        proc.stop()
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            print(f"----- web -----\n{proc.output()[-12000:]}")


def test_launches_while_backends_are_terminated_answer_201_for_each_committed_session_else_503(web, alice):
    from accounts.services import login_token_issue
    from sessions.models import ComputeSession

    token = login_token_issue(user=alice)
    answers: dict[str, tuple[int, dict]] = {}
    killer = Killer(database_url_default())
    killer.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            while time.monotonic() - started < DEADLINE_S:
                names = [f"cut-{uuid.uuid4().hex[:10]}" for _ in range(CLIENTS * 2)]
                results = pool.map(lambda n: (n, launch(web, token, n, keyed=n[-1] in "02468ace")), names)
                answers.update(results)
                statuses = [status for status, _ in answers.values()]
                if statuses.count(503) >= ENOUGH_CUT and statuses.count(201) >= ENOUGH_CREATED:
                    break
    finally:
        killer.stop.set()
        killer.join(timeout=10)
    fresh_connections()
    by_name: dict[str, list] = {}
    for session in ComputeSession.objects.filter(name__in=list(answers)):
        by_name.setdefault(session.name, []).append(session)
    counts = {status: sum(1 for s, _ in answers.values() if s == status) for status, _ in answers.values()}
    print(f"launch-commit: {len(answers)} launches, answers {counts}, {killer.killed} backends terminated, "
          f"{time.monotonic() - started:.1f} s")

    odd = {name: answer for name, answer in answers.items() if answer[0] not in (201, 503)}
    assert not odd, f"answers other than 201 and 503: {list(odd.items())[:5]}"
    for name, (status, body) in answers.items():
        sessions = by_name.get(name, [])
        if status == 201:
            assert [str(s.pk) for s in sessions] == [body["id"]], (name, body, sessions)
            assert body["name"] == name and body["status"] == "PENDING"
        else:
            assert body["type"] == "service-unavailable", body
            assert not sessions, f"{name}: answered 503 but its session {sessions[0].pk} was committed"
    assert counts.get(503, 0) >= ENOUGH_CUT, f"too few launches were cut off to tell: {counts}"
    assert counts.get(201, 0) >= ENOUGH_CREATED, f"too few launches went through: {counts}"


def backends_of(database_url: str) -> int:
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [name]).fetchone()[0]


def test_after_every_backend_is_terminated_once_the_next_launches_go_through(web, alice):
    """The web's pool holds dead connections after a mass termination (or a database restart);
    the first request that meets them answers 503 and has the pool's other idle connections
    checked and replaced (common.api_errors.database_pool_check), so the launches after it go
    through instead of each meeting dead connections of their own (2 to 3 of 12 answered 503 per
    round without the check, 1 with it)."""
    from accounts.services import login_token_issue

    token = login_token_issue(user=alice)
    database_url = database_url_default()
    with ThreadPoolExecutor(8) as pool:  # the web's pool grows to several connections
        assert set(pool.map(lambda i: launch(web, token, f"warm-{i}", False)[0], range(16))) == {201}
    cut = []
    for round_ in range(3):
        terminate_backends(database_url)
        wait_until(lambda: backends_of(database_url) == 0, timeout=10, what="the terminated backends to be gone")
        statuses = [launch(web, token, f"after-{round_}-{i}", False)[0] for i in range(12)]
        assert set(statuses) <= {201, 503} and statuses[-8:] == [201] * 8, statuses
        cut.append(statuses.count(503))
    print(f"launch-commit: 503 answers after each mass termination: {cut}")
    assert sum(cut) <= 4, cut
    fresh_connections()
