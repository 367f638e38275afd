"""Shared fixtures. The suite runs against real PostgreSQL and Redis (`make test` sets
DATABASE_URL and REDIS_URL); in-process tests run Celery tasks eagerly, the end-to-end
tests start real daphne, Celery and agent processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from accelerators.plugins.base import DeviceInfo

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


@pytest.fixture(autouse=True)
def eager_celery():
    """In-process tests run tasks where they are sent (the e2e tests use real workers)."""
    from console.celery import app

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
    """An APIClient sending `user`'s DRF token (anonymous for None)."""
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


def wait_until(predicate, *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose output goes to a log file, shown when a test fails."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_dir: Path, cwd: Path = ROOT):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, 15)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()
        self._log.close()


@pytest.fixture
def procs(tmp_path, request):
    """Start processes with `procs.start(name, argv, env)`; stopped (and their logs printed on
    failure) at teardown."""

    class Procs(list):
        def start(self, name, argv, env):
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


# --- the distributed stack (end-to-end tests) -----------------------------------------------------

@dataclass
class StackNode:
    """One agent process: its node name, its mock-accelerator.toml text, and agent.toml's
    `cpu-count` and `memory`."""

    name: str
    mock_toml: str
    cpu_count: int = 4
    memory: str = "16G"
    devices: int = 1  # how many devices the mock inventory lists (the node counts as up once all are there)


@dataclass
class Stack:
    base: str  # http://127.0.0.1:<port>
    redis_url: str
    env: dict  # the web's and manager's environment
    agents: dict  # node name → Proc


@pytest.fixture
def distributed_stack(tmp_path, procs):
    """Start the distributed processes: `distributed_stack(nodes=[StackNode…], redis_db=N)` →
    Stack, once daphne answers and every node is ALIVE with all its devices.

    daphne, a Celery manager worker with beat (threads, concurrency 4) and one agent process
    per node, against the test database (the test needs `django_db(transaction=True)`) and
    Redis database `redis_db`, flushed first so stale queues cannot interfere (the suite's
    e2e tests each use their own: 7, 11; FGPU_TEST_STACK_REDIS_DB overrides it, for a run that
    must keep to one Redis database beside others sharing the server). Fractional settings and slot formats are imported
    from demo/ as an administrator would (unit_mem 4 GiB, unit_proc 40, quantum 0.25). Agents
    get an unreachable DATABASE_URL: they must never need the database."""
    import redis
    from django.conf import settings
    from django.db import connection

    def start(*, nodes: list[StackNode], redis_db: int) -> Stack:
        from accelerators.models import Node, NodeStatus

        redis_db = int(os.environ.get("FGPU_TEST_STACK_REDIS_DB") or redis_db)
        redis_url = f"{settings.REDIS_URL.rsplit('/', 1)[0]}/{redis_db}"
        redis.Redis.from_url(redis_url).flushdb()
        db = connection.settings_dict
        database_url = (f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/"
                        f"{db['NAME']}")
        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url,
               "FGPU_DATA_DIR": str(tmp_path / "data"), "FGPU_HEARTBEAT_INTERVAL": "2", "PYTHONUNBUFFERED": "1"}
        env.pop("FGPU_CELERY_EAGER", None)
        bin_dir = Path(sys.executable).parent
        python = str(bin_dir / "python")
        for path in (ROOT / "demo" / "mock-accelerator.toml", ROOT / "demo" / "accelerator.json"):
            out = subprocess.run([python, "manage.py", "import_accelerator_config", str(path)], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
        port = free_port()
        procs.start("web", [str(bin_dir / "daphne"), "-b", "127.0.0.1", "-p", str(port), "console.asgi:application"],
                    env)
        procs.start("manager", [str(bin_dir / "celery"), "-A", "console", "worker", "-Q", "manager", "--pool",
                                "threads", "--concurrency", "4", "-B", "--schedule", str(tmp_path / "beat-schedule"),
                                "--loglevel", "INFO", "--hostname", f"manager@redis{redis_db}"], env)
        agent_env = {**env, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
        agents = {}
        for node in nodes:
            node_dir = tmp_path / "nodes" / node.name
            node_dir.mkdir(parents=True)
            (node_dir / "mock-accelerator.toml").write_text(node.mock_toml)
            (node_dir / "agent.toml").write_text(
                f'[agent]\nid = "{node.name}"\nallowed-compute-plugins = ["ai.backend.accelerator.mock"]\n'
                f'cpu-count = {node.cpu_count}\nmemory = "{node.memory}"\n[container]\nscratch-root = "scratches"\n')
            agents[node.name] = procs.start(f"agent-{node.name}", [python, "manage.py", "agent", "--config",
                                                                   str(node_dir / "agent.toml")], agent_env)
        base = f"http://127.0.0.1:{port}"

        def web_up():
            try:
                with urllib.request.urlopen(base + "/api/schema/", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False

        def started(predicate, *, timeout: float, what: str) -> None:
            # The processes' logs go into the failure itself: pytest shows no output of a
            # fixture's teardown (where `procs` prints them) when the setup failed.
            try:
                wait_until(predicate, timeout=timeout, what=what)
            except AssertionError as exc:
                logs = "".join(f"\n----- {proc.name} log -----\n{proc.output()[-4000:]}" for proc in procs)
                raise AssertionError(f"{exc}{logs}") from None

        started(web_up, timeout=30, what="daphne to answer")

        def nodes_alive():
            assert all(agent.popen.poll() is None for agent in agents.values()), "an agent exited (its log follows)"
            alive = {n.name: n.devices.count() for n in Node.objects.filter(name__in=[x.name for x in nodes],
                                                                              status=NodeStatus.ALIVE)}
            return all(alive.get(node.name, 0) >= node.devices for node in nodes)

        started(nodes_alive, timeout=60, what="every agent to register its node")
        return Stack(base=base, redis_url=redis_url, env=env, agents=agents)

    return start


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def mock_gpu(index: int = 0, *, memory: int = 8 * GiB, sms: int = 80, numa: int | None = 0) -> DeviceInfo:
    uuid = f"GPU-00000000-0000-0000-0000-{index:012d}"
    return DeviceInfo(slot_name="cuda", device_id=uuid, index=index, mother_uuid=uuid[4:], model_name="CUDA GPU",
                      numa_node=numa, subproc_count=sms, memory_size=memory)


@pytest.fixture
def demo_cluster(db):
    """The walkthrough's cluster: node `demo-node`, one 8 GiB / 80-SM GPU, fractional mode with
    unit_mem 4 GiB and unit_proc 40 ("1 physical GPU = 2 fGPU"), quantum 0.25."""
    return make_cluster(nodes={"demo-node": [mock_gpu(0)]})


def make_cluster(*, nodes: dict[str, list[DeviceInfo]], unit_mem: int = 4 * GiB, unit_proc: int = 40,
                 quantum: str = "0.25", mode: str = "fractional", cpu: int = 8, mem: int = 32 * GiB):
    from accelerators.models import FractionalSettings, SlotFormat
    from accelerators.services import node_inventory_apply

    created = {name: node_inventory_apply(node_name=name, devices=devices, plugins=["ai.backend.accelerator.mock"],
                                          attributes={}, cpu_count=cpu, memory_size=mem)
               for name, devices in nodes.items()}
    FractionalSettings.objects.update_or_create(
        slot_name="cuda", defaults={"allocation_mode": mode, "unit_mem": unit_mem, "unit_proc": unit_proc,
                                    "quantum_size": Decimal(quantum)})
    SlotFormat.objects.update_or_create(slot_name="cuda", subtype="shares",
                                        defaults={"display_unit": "fGPU", "human_readable_name": "fGPU",
                                                  "number_round_length": 2})
    return created
