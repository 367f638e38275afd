"""Shared fixtures. The suite runs against real PostgreSQL and Redis (`make test` sets
DATABASE_URL and REDIS_URL); in-process tests run Celery tasks eagerly, the end-to-end
tests start real uvicorn, Celery and agent processes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.seed import GiB, make_cluster, mock_gpu, one_round_password_hashing  # noqa: F401 (re-exported)
from tests.stack import ROOT, Proc, Stack, StackNode, free_port, wait_until, wait_until_async  # noqa: F401 (re-exported)

if os.environ.get("PYTEST_XDIST_WORKER") and "tests.xdist_worker" not in sys.modules:
    # Without it every worker would flush and share the same Redis databases and cgroup tag.
    raise pytest.UsageError("pytest -n needs -p tests.xdist_worker (and PYTHONPATH=.): make test XDIST=N adds both")


def _secret_key_for_this_run() -> None:
    """The console's SECRET_KEY for this run (common.secret_key): FGPU_SECRET_KEY when it is given
    and usable, else the random key settings made for this process, put into the environment that
    every process the tests start inherits (tests.stack), so a sign-in cookie made here is valid there."""
    from django.conf import settings

    if settings.SECRET_KEY_PROBLEM is not None:
        os.environ["FGPU_SECRET_KEY"] = settings.SECRET_KEY
        settings.SECRET_KEY_PROBLEM = None


_secret_key_for_this_run()
one_round_password_hashing()

# The standalone consoles the tests start (tests/test_browser*.py, test_cli_standalone.py, …) copy this
# environment and run sessions as processes unless a test sets FGPU_RUNTIME itself: standalone's
# default, auto, picks docker where Docker Engine holds the session image (CI). tests/test_runtime_choice.py
# starts them with auto.
os.environ.setdefault("FGPU_RUNTIME", "process")
# And they, and the stacks' agents, stop their sessions when they exit, as they did before a graceful stop
# left them running for the next start (tests/faults/test_console_restart.py tests that default itself).
os.environ.setdefault("FGPU_STOP_SESSIONS_ON_EXIT", "true")


# Tests that run alone, after the rest, when the suite runs in pytest-xdist workers (`make test`: the `serial` marker;
# Makefile's test target). Each either turns shared things off and on (PostgreSQL backends terminated, the network
# namespaces and bridge of a multi-host bed, whose first `ip netns add` on a machine mounts /run/netns) or counts
# what a burst of launches got done within a deadline (the fault tests' 20-of-N and pool timeouts of 1 s, an answer
# within 2 s, a node LOST and fenced by heartbeat timeouts of seconds), which a neighbour worker's load on the 2-core
# machine would decide instead of the code. Seen failing beside 2 workers at load 20: test_launch_commit (15 of 20),
# test_concurrency (a pool's 1 s), the multi-host walk (nsenter EINVAL). tests/faults' modules are serial by default; those
# modules listed in IN_WORKERS run in the workers (issue 34.5), as none of those does either: test_fencing.py and
# test_refused_characters.py run in-process (eager Celery, the WSGI test client; a node's silence is its
# last_heartbeat moved back), test_console_restart.py runs standalone consoles on SQLite and data dirs of their own
# (its one distributed stack has a private Redis), and test_cluster_view_race.py's writers race on the worker's own
# test database with no deadline (300 s).
SERIAL = (
    "tests/faults/",  # each module serial unless IN_WORKERS names it: a new fault test is serial until shown otherwise
    "tests/multihost/",
    "tests/test_concurrency.py",
    "tests/test_concurrency_processes.py",
)
IN_WORKERS = (  # of the SERIAL folders: modules shown to need none of that (above)
    "tests/faults/test_console_restart.py",
    "tests/faults/test_fencing.py",
    "tests/faults/test_refused_characters.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark the SERIAL modules' tests `serial` (pyproject.toml's markers), but IN_WORKERS'."""
    for item in items:
        if item.nodeid.startswith(SERIAL) and not item.nodeid.startswith(IN_WORKERS):
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a transactional test, whose teardown flushes every table, the rows the migrations
    seed (the built-in "host" session image, sessions/migrations/0007) are written again, so the
    tests after it see the database as a fresh one is; the seeding function is the migration's own."""
    result = yield
    marker = item.get_closest_marker("django_db")
    transactional = (marker is not None and marker.kwargs.get("transaction")) or "transactional_db" in getattr(
        item, "fixturenames", ())
    if transactional and nextitem is not None:  # after the last test the test database is gone
        import importlib

        from django.apps import apps
        from pytest_django.plugin import blocking_manager_key

        seed = importlib.import_module("sessions.migrations.0007_session_images").create_host_image
        with item.config.stash[blocking_manager_key].unblock():
            seed(apps, None)
    return result


@pytest.fixture(scope="session", autouse=True)
def flush_by_delete():
    """A transactional test's teardown empties the tables with one DELETE per table, not Django's
    one TRUNCATE of them all: on PostgreSQL a TRUNCATE gives each of the ~40 tables a new file,
    which took 1 s a test on the shared 2-core machine (most of a transactional test's time), a
    DELETE of a few rows a few ms. The same rows are gone: every foreign key Django makes is
    DEFERRABLE INITIALLY DEFERRED, so the order does not matter within the flush's transaction, and
    the triggers a DELETE fires (sessions/migrations/0013) only touch rows deleted with it. Sequences
    are not reset either way (Django's `reset_sequences`, which keeps its TRUNCATE … RESTART IDENTITY)."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or allow_cascade or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return ["SET CONSTRAINTS ALL DEFERRED;", *(f"DELETE FROM {self.quote_name(table)};" for table in tables)]

    DatabaseOperations.sql_flush = sql_flush
    yield
    DatabaseOperations.sql_flush = truncate


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    """Close every PostgreSQL connection pool before pytest-django switches to the test
    database. Django keeps one pool per alias (console/settings.py) and does not close it when
    create_test_db renames the database: a pool opened while collecting (tests/test_openapi.py
    fetches the schema through WSGI at import) kept serving connections to the real database,
    so the migrations and every in-process test ran there while the processes of an end-to-end
    stack, given the test database's URL, found it empty."""
    from django.db import connections

    for connection in connections.all():
        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()


# This run's agents (in this process and in the processes it starts, which inherit it) name their
# parent cgroups `fgpu-agent-<tag>-<node>-<instance>` (agent.runtimes.parent_cgroup_name), so the
# fixture below finds what this run made and never touches another run's or a console's.
CGROUP_TAG = os.environ.setdefault("FGPU_CGROUP_TAG", f"test{os.getpid()}")


@pytest.fixture(autouse=True)
def no_cgroups_left():
    """Every test leaves the node's cgroups as it found them: the agents' parent cgroups this
    test run's agents created (`fgpu-agent-<FGPU_CGROUP_TAG>-…` under the cgroup v2 root and in
    the cgroup v1 hierarchies of memory, cpu and pids, agent.limits) are gone when the test ends.
    What is left is killed and removed, and the test fails saying so; cgroups of other runs and
    of consoles on the machine are never looked at."""
    before = set(agent_cgroups())
    yield
    left = sorted(set(agent_cgroups()) - before)
    for parent in left:
        remove_cgroup_tree(parent)
    assert not left, f"the test left cgroups behind: {[str(p) for p in left]}"


def agent_cgroups() -> list:
    """This run's agents' parent cgroups: under the cgroup v2 root and in each cgroup v1
    hierarchy of agent.limits' controllers."""
    from agent.limits import cgroup_v1_mounts
    from agent.runtimes import CGROUP_AUTO, cgroup2_root

    root, _ = cgroup2_root(CGROUP_AUTO)
    tops = sorted({*([root] if root is not None else []), *cgroup_v1_mounts().values()})
    prefix = f"fgpu-agent-{CGROUP_TAG}-"
    return [p for top in tops for p in top.iterdir() if p.is_dir() and p.name.startswith(prefix)]


def remove_cgroup_tree(parent) -> None:
    """Kill what `parent`'s session cgroups hold (cgroup v2's cgroup.kill; each pid in a v1
    hierarchy) and remove them, then `parent`."""
    import time

    from agent.runtimes import CGROUP_EMPTY_WAIT_S, SessionCgroups, _remove_v1

    if (parent / "cgroup.events").exists():  # cgroup v2
        cgroups = SessionCgroups(parent)
        cgroups.clean_up()
        cgroups.close()
        return
    deadline = time.monotonic() + CGROUP_EMPTY_WAIT_S
    for child in [c for c in parent.iterdir() if c.is_dir()]:
        _remove_v1(child, deadline)
    _remove_v1(parent, deadline)


@pytest.fixture(autouse=True)
def eager_celery():
    """In-process tests run tasks where they are sent (the e2e tests use real workers)."""
    from common.celery import app

    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each in-process test gets a new channel layer object (same configured backend and Redis).
    Tests run their websocket scenarios with `asyncio.run`, a new event loop each, while
    channels_redis keeps per-channel asyncio locks on the layer object; a receive cancelled while
    waiting for one (an exec timeout, a closed socket) leaves that lock behind, bound to a loop
    that is gone, and the next test to contend for it fails with "bound to a different event
    loop". A server process has one loop per layer, so this only happens across tests."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def private_cache(request):
    """Each in-process test gets a cache of its own: the login throttle counts failed logins
    per address (all tests log in from 127.0.0.1) in the default cache, which is the shared
    Redis database when REDIS_URL is set, so counts would carry over between tests and runs.
    tests/test_accounts.py checks the throttle against the configured Redis cache as well.
    (override_settings, not pytest-django's `settings`: some tests have a parameter of that name.)"""
    from django.test import override_settings

    with override_settings(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                               "LOCATION": request.node.nodeid}}):
        yield


# --- people and API clients (no passwords: hashing is slow and not under test) ------------------

@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob")


@pytest.fixture
def staff(django_user_model):
    """An administrator (`is_staff`: what the API checks)."""
    return django_user_model.objects.create_user("root", is_staff=True)


@pytest.fixture
def admin(django_user_model):
    """An administrator who may also use every admin page (`is_superuser` too)."""
    return django_user_model.objects.create_user("root", is_staff=True, is_superuser=True)


def client_for(user):
    """An APIClient sending a login token of `user`'s (anonymous for None)."""
    from rest_framework.test import APIClient

    from accounts.services import login_token_issue

    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {login_token_issue(user=user)}")
    return client


@pytest.fixture
def procs(tmp_path, tmp_path_factory, request):
    """Start processes with `procs.start(name, argv, env)`; stopped (and their logs printed on
    failure) at teardown."""

    class Procs(list):
        def start(self, name, argv, env):
            standalone_database_seed(argv, env, tmp_path_factory)
            proc = Proc(name, argv, env=env, log_dir=tmp_path)
            self.append(proc)
            return proc

    started = Procs()
    yield started
    for proc in reversed(started):
        proc.stop()
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        for proc in started:
            sys.stderr.write(f"\n----- {proc.name} log -----\n{proc.log_path.read_text(errors='replace')[-8000:]}\n")


STANDALONE_DATABASE = ("fgpu.sqlite3", "fgpu.sqlite3-wal", "fgpu.sqlite3-shm")  # console/settings_standalone.py, WAL
_standalone_template: list = []  # the migrated data directory, made once per test run


def standalone_database_seed(argv: list, env: dict, tmp_path_factory) -> None:
    """Before `manage.py standalone` first starts on a data directory (env's FGPU_DATA_DIR, which
    holds no database yet), put there a copy of a SQLite database `manage.py migrate` made once
    for the run, with standalone's settings: its own migrate then finds nothing to apply. A fresh
    migrate took 3 s of CPU (11 s on the shared machine) of each of the suite's ~50 standalone
    starts. Everything else of a first start (the demo's settings, images and admin, its secret
    key) is standalone's own, as before: it tells a first start by its settings, not by the file."""
    data = env.get("FGPU_DATA_DIR")
    if argv[1:3] != ["manage.py", "standalone"] or not data or (Path(data) / STANDALONE_DATABASE[0]).exists():
        return
    if not _standalone_template:
        template = tmp_path_factory.mktemp("standalone-template")
        migrate_env = {**env, "FGPU_DATA_DIR": str(template), "DJANGO_SETTINGS_MODULE": "console.settings_standalone"}
        done = subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=ROOT, env=migrate_env,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"migrating the standalone template failed:\n{done.stdout}{done.stderr}"
        _standalone_template.append(template)
    Path(data).mkdir(parents=True, exist_ok=True)
    for name in STANDALONE_DATABASE:
        if (_standalone_template[0] / name).exists():
            shutil.copyfile(_standalone_template[0] / name, Path(data) / name)


# --- the distributed stack (end-to-end tests) -----------------------------------------------------

@pytest.fixture
def distributed_stack(tmp_path, request):
    """Start the distributed processes: `distributed_stack(nodes=[StackNode…], redis_db=N)` →
    tests.stack.Stack, once uvicorn answers and every node is ALIVE with all its devices.

    uvicorn, a Celery manager worker (threads, concurrency 4, without gossip and mingle), one
    beat process and one agent process per node (tests/stack.py), against the test database
    (the test needs `django_db(transaction=True)`) and Redis database `redis_db`, flushed first
    so stale queues cannot interfere (the suite's e2e tests each use their own: 7, 11;
    FGPU_TEST_STACK_REDIS_DB overrides it, for a run that must keep to one Redis database beside
    others sharing the server). Fractional settings and slot formats are imported from demo/ as
    an administrator would (unit_mem 4 GiB, unit_proc 40, quantum 0.25). Agents get an
    unreachable DATABASE_URL: they must never need the database. The processes are stopped at
    teardown, their logs printed when the test failed."""
    from django.conf import settings

    stacks: list[Stack] = []

    def start(*, nodes: list[StackNode], redis_db: int) -> Stack:
        redis_db = int(os.environ.get("FGPU_TEST_STACK_REDIS_DB") or redis_db)
        stack = Stack(nodes=nodes, work_dir=tmp_path, redis_url=f"{settings.REDIS_URL.rsplit('/', 1)[0]}/{redis_db}")
        stacks.append(stack)
        return stack.start(timeout=60)

    yield start
    report = getattr(request.node, "rep_call", None)
    for stack in stacks:
        stack.close()
        if report is not None and report.failed:
            sys.stderr.write(stack.logs(tail=8000))


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def demo_cluster(db):
    """The walkthrough's cluster: node `demo-node`, one 8 GiB / 80-SM GPU, fractional mode with
    unit_mem 4 GiB and unit_proc 40 ("1 physical GPU = 2 fGPU"), quantum 0.25."""
    return make_cluster(nodes={"demo-node": [mock_gpu(0)]})


# --- sessions and the API's error shape (each written once here; the test modules use these) ----

ERROR_KEYS = {"type", "title", "detail", "field_errors"}  # the API's one error shape (README: "Errors")


def assert_error_shape(response, status: int) -> dict:
    """Assert `response` is the API's error: HTTP `status`, a JSON body of exactly ERROR_KEYS with
    a non-empty `detail` and `field_errors` a dict (of field → messages). Returns the body."""
    assert response.status_code == status, (response.status_code, response.content[:500])
    body = response.json()
    assert set(body) == ERROR_KEYS, body
    assert isinstance(body["field_errors"], dict), body
    assert body["detail"], body
    return body


def make_running(session):
    """A SCHEDULED session (a ComputeSession or its id) moved on as its agent reports it:
    PREPARING, then RUNNING. Returns the ComputeSession, read again, RUNNING."""
    from sessions.lifecycle import services
    from sessions.models import ComputeSession, SessionStatus

    session_id = str(getattr(session, "pk", session))
    for status in (SessionStatus.PREPARING, SessionStatus.RUNNING):
        assert services.session_report_apply(session_id=session_id, status=status)
    running = ComputeSession.objects.get(pk=session_id)
    assert running.status == SessionStatus.RUNNING, running.status_reason
    return running


@pytest.fixture
def alices_session(demo_cluster, alice):
    """Alice's 0.5 fGPU session "alices", placed by a scheduler pass and RUNNING on demo-node as
    its agent would report it (no process behind it)."""
    from sessions.admission import launch as admission
    from sessions.scheduling.scheduler import schedule_pending

    session = admission.session_create(owner=alice, name="alices", resources={"cuda.shares": "0.5"})
    schedule_pending()
    return make_running(session)
