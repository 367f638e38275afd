"""The distributed stack as real processes, for end-to-end tests, fault injection and benchmarks.

    from tests.stack import Stack, StackNode, mock_inventory

    with Stack(nodes=[StackNode("node-0", mock_inventory(gpus=2), devices=2)], work_dir=tmp) as stack:
        stack.base                      # http://127.0.0.1:<port> (uvicorn)
        stack.kill("manager")           # SIGKILL its whole process group
        stack.restart("manager")        # the same command again (a new log file)
        stack.redis_stop(); stack.redis_start()   # a private broker only
        stack.terminate_backends()      # every PostgreSQL backend of the stack's database

Processes, each in a process group of its own (`start_new_session`) so that a kill takes all of
it, each with its output in `<work_dir>/<name>.log` (`<name>.<n>.log` after the n-th restart):

| name | command |
|---|---|
| `redis` | `redis-server --port N --save "" --appendonly no` (only with `redis_url=None`: a private broker; with `broker_acl=True` its ACL users come from common/broker_acl.py and each process gets its role's URL) |
| `web` | `uvicorn console.asgi:application` |
| `manager` | `celery -A console worker -Q manager --pool threads --concurrency 4 --without-gossip --without-mingle` |
| `beat` | `celery -A console beat` (one beat, a process of its own, as the README runs it) |
| `agent-<node>` | `python manage.py agent --config <work_dir>/nodes/<node>/agent.toml` |

The database is the one Django's default connection uses (under pytest: the test database; the
test needs `django_db(transaction=True)` so the processes see its rows), unless `database_url`
names another; it must be migrated. Agents get an unreachable DATABASE_URL: they must never need
the database. Fractional settings and slot formats are imported from demo/ as an administrator
would (unit_mem 4 GiB, unit_proc 40, quantum 0.25: an 8 GiB / 80-SM GPU is 2 fGPU).

No pytest here: a plain script (a benchmark) uses it as well, after `django.setup()`.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PYTHON = str(BIN / "python")


def wait_until(predicate: Callable, *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned); AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)  # noqa: TID251 (the one poll interval of the tests' condition waits)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


async def wait_until_async(predicate: Callable, *, timeout: float = 30.0, interval: float = 0.1,
                           what: str = "condition"):
    """`wait_until` on an event loop: poll `predicate` (a function, or a coroutine function, whose
    result is awaited) until it returns a truthy value (returned), sleeping `interval` s between
    tries without blocking the loop; AssertionError after `timeout` s, also when an awaited
    `predicate` is still running then."""
    last = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                last = predicate()
                if inspect.isawaitable(last):
                    last = await last
                if last:
                    return last
                await asyncio.sleep(interval)  # noqa: TID251 (the one poll interval of the tests' async condition waits)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}") from None


class ApiClient:
    """A user of the REST API: launches and deletes with retries on 5xx and dropped connections,
    each launch with its own Idempotency-Key (and the same key on every retry)."""

    def __init__(self, base: str, token: str):
        self.base, self.token = base, token
        self.posts = 0

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        request = urllib.request.Request(self.base + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Token {self.token}",
                                                  "Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=15) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw or b"null")
            except ValueError:
                return exc.code, {"raw": raw[:200].decode(errors="replace")}
        except OSError as exc:  # refused, reset, timed out: the web process is down
            return 0, {"error": str(exc)}

    def with_retries(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                     *, deadline_s: float = 120):
        give_up = time.monotonic() + deadline_s
        while True:
            status, answer = self.call(method, path, body, headers)
            if status and status < 500:
                return status, answer
            if time.monotonic() > give_up:
                return status, answer
            time.sleep(0.5)  # noqa: TID251 (a client backing off between retries, not a test waiting)

    def launch(self, name: str, body: dict) -> tuple[int, dict]:
        return self.with_retries("POST", "/api/v1/sessions/", {"name": name, **body}, {"Idempotency-Key": name})

    def delete(self, session_id: str):
        return self.with_retries("DELETE", f"/api/v1/sessions/{session_id}/")


def free_port() -> int:
    """A free TCP port of 127.0.0.1 whose next port is free too: a standalone console serves its
    session apps on PORT + 1 (FGPU_APPS_PORT's default), which a test's console must find free."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Proc:
    """A child process in a process group of its own, its output in a log file."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_dir: Path, cwd: Path = ROOT,
                 log_name: str | None = None):
        self.name = name
        self.argv, self.env, self.cwd = argv, env, cwd
        self.log_path = Path(log_dir) / f"{log_name or name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        if not self._log.closed:  # closed once the process was killed
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole process group (its leader may be gone, its children not)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the process group and reap the leader."""
        self.signal(signal.SIGKILL)
        self.popen.wait()
        self._log.close()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` s; the group's stragglers are killed either way."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


@dataclass
class StackNode:
    """One agent process: its node name, its mock-accelerator.toml text, agent.toml's
    `cpu-count` and `memory`, how many devices its inventory lists (the node counts as up once
    all are registered), its runtime ("process" or "docker": network none, the test image),
    `scratch-retention` (seconds; None: agent.toml's default), `cgroup-root` and more `[container]` lines."""

    name: str
    mock_toml: str
    cpu_count: int = 4
    memory: str = "16G"
    devices: int = 1
    runtime: str = "process"
    scratch_retention: int | None = None
    cgroup_root: str | None = None  # agent.toml's [container] cgroup-root (None: its default, "auto")
    container: str = ""  # more lines of agent.toml's [container] table (e.g. 'terminal-direct = false')
    command_prefix: tuple[str, ...] = ()  # what the agent's command runs under (tests/multihost: nsenter into its host's netns)
    env: dict | None = None  # more environment variables of its agent

    def agent_toml(self) -> str:
        retention = "" if self.scratch_retention is None else f"scratch-retention = {self.scratch_retention}\n"
        cgroups = "" if self.cgroup_root is None else f'cgroup-root = "{self.cgroup_root}"\n'
        return (f'[agent]\nid = "{self.name}"\nallowed-compute-plugins = ["ai.backend.accelerator.mock"]\n'
                f'cpu-count = {self.cpu_count}\nmemory = "{self.memory}"\n[container]\nscratch-root = "scratches"\n'
                f'{retention}{cgroups}runtime = "{self.runtime}"\nnetwork = "none"\ndefault-image = "fgpu-session:test"\n'
                f'{self.container}\n')


def web_command(port: int, application: str = "console.asgi:application") -> list[str]:
    """The web process's command line, as the README runs it (`uvicorn console.asgi:application`),
    listening on 127.0.0.1:`port`; `application`: another ASGI app to serve the same way."""
    return [str(BIN / "uvicorn"), "--host", "127.0.0.1", "--port", str(port), application]


def web_answers(base: str) -> bool:
    """Whether the web process at `base` (http://host:port) serves Django's pages: its sign-in page
    (the API schema it asked for before cost the web process a build of about 1 s of CPU a start)."""
    try:
        with urllib.request.urlopen(base + "/login/", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def mock_inventory(*, gpus: int = 1, memory: str = "8G", sms: int = 80, uuid_prefix: str | None = None) -> str:
    """demo/mock-accelerator.toml with `gpus` devices of `memory` and `sms` each. Their UUIDs
    start with `uuid_prefix` (8 hex digits; random when None), so two nodes never share one."""
    prefix = uuid_prefix or uuid.uuid4().hex[:8]
    demo = (ROOT / "demo" / "mock-accelerator.toml").read_text()
    start = demo.index("devices = [")
    end = demo.index("]\n", start) + 2
    lines = "".join(f'  {{ mother_uuid = "{prefix}-0000-4000-8000-{i:012d}", model_name = "CUDA GPU", numa_node = 0, '
                    f'subproc_count = {sms}, memory_size = "{memory}", is_mig_device = false }},\n' for i in range(gpus))
    return demo[:start] + f"devices = [\n{lines}]\n" + demo[end:]


def database_url_default() -> str:
    """The URL of Django's default connection (the test database under pytest)."""
    from django.db import connection

    db = connection.settings_dict
    auth = db["USER"] or "postgres"
    if db.get("PASSWORD"):
        auth += f":{db['PASSWORD']}"
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


class Stack:
    """The distributed processes of one test or benchmark run (see the module's docstring).

    `nodes`: one agent each. `work_dir`: logs, agent configs (`nodes/<name>/`), data dir, beat
    schedule. `redis_url`: a Redis database to use (flushed first when `flush_redis`); None
    starts a private redis-server on a free port, which `redis_stop` / `redis_start` take down
    and bring back (its data is gone then: queues, groups). `env`: extra variables for every
    process (e.g. FGPU_HEARTBEAT_TIMEOUT). `start()` returns once the web process answers and every node
    is ALIVE with all its devices."""

    def __init__(self, *, nodes: Iterable[StackNode], work_dir: Path, redis_url: str | None = None,
                 database_url: str | None = None, env: dict | None = None, heartbeat_interval: int = 2,
                 flush_redis: bool = True, broker_acl: bool = False, node_keys: bool = False,
                 redis_address: str = "127.0.0.1"):
        self.nodes = list(nodes)
        self.want_node_keys = node_keys  # each agent gets a node key (`manage.py node_key`; FGPU_NODE_KEY)
        self.node_keys: dict[str, str] = {}  # with node_keys: node name → its agent key
        assert not broker_acl or redis_url is None, "broker_acl needs the private broker"
        self.broker_users = {}  # with broker_acl: user name → common.broker_acl.BrokerUser
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.private_redis = redis_url is None
        self.redis_port = free_port() if self.private_redis else 0
        self.redis_address = redis_address  # where the private broker listens (tests/multihost: the bridge's address)
        # Off the loopback, Redis takes clients with a password only (its protected mode): one of this run's own.
        self.redis_password = "" if redis_address == "127.0.0.1" or broker_acl else secrets.token_hex(16)
        auth = f":{self.redis_password}@" if self.redis_password else ""
        self.redis_url = redis_url or f"redis://{auth}{redis_address}:{self.redis_port}/0"
        if broker_acl:
            from common.broker_acl import MANAGER, BrokerUser, broker_users

            self.broker_users = {u.name: u for u in broker_users([n.name for n in self.nodes])}
            # The harness's own user, to read the ACL log: in the test only, never in a deployment.
            self.broker_users["fgpu-test-admin"] = BrokerUser("fgpu-test-admin", uuid.uuid4().hex, "~* &* +@all")
            self.redis_url = self.broker_users[MANAGER].url(self.redis_url)  # what the harness itself uses
        self.database_url = database_url
        self.extra_env = dict(env or {})
        self.heartbeat_interval = heartbeat_interval
        self.flush_redis = flush_redis
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # Session apps' own origin: the same uvicorn, told apart by the Host (another site to the browser).
        self.apps_base = f"http://localhost:{self.port}"
        self.env: dict = {}
        self.procs: dict[str, Proc] = {}  # name → the current process of that name
        self.history: list[Proc] = []  # every process started, restarts included, in order
        self._commands: dict[str, tuple[list[str], dict]] = {}

    # --- starting and stopping ---------------------------------------------------------------

    def start(self, *, timeout: float = 90.0) -> Stack:
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        if self.private_redis:
            acl = []
            if self.broker_users:
                from common.broker_acl import acl_file

                (self.work_dir / "users.acl").write_text(acl_file(list(self.broker_users.values())))
                acl = ["--aclfile", str(self.work_dir / "users.acl")]
            elif self.redis_password:
                acl = ["--requirepass", self.redis_password]
            self._run("redis", ["redis-server", "--port", str(self.redis_port), "--bind", self.redis_address, "--save", "",
                                "--appendonly", "no", "--dir", str(self.work_dir), *acl], dict(os.environ))
            self._wait_for(self.redis_answers, timeout=20, what="the private Redis to answer")
        elif self.flush_redis:
            import redis

            redis.Redis.from_url(self.redis_url).flushdb()
        env = {**os.environ, "DATABASE_URL": self.database_url or database_url_default(), "REDIS_URL": self.redis_url,
               "FGPU_DATA_DIR": str(self.work_dir / "data"), "FGPU_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
               "PYTHONUNBUFFERED": "1", "FGPU_APPS_ORIGIN": self.apps_base, **self.extra_env}
        env.pop("FGPU_CELERY_EAGER", None)
        if len(env.get("FGPU_SECRET_KEY", "")) < 32:  # web, manager and beat refuse to start without one
            env["FGPU_SECRET_KEY"] = secrets.token_urlsafe(48)  # this stack's own (a test run has one: conftest)
        self.env = env
        if self.database_url is None:
            self._import_settings_here()
        else:
            self._import_settings_in_a_process(env)
        self._run("web", web_command(self.port), self._role_env(env, "fgpu-web"))
        self._run("manager", [str(BIN / "celery"), "-A", "console", "worker", "-Q", "manager", "--pool", "threads",
                              "--concurrency", "4", "--without-gossip", "--without-mingle", "--loglevel", "INFO",
                              "--hostname", f"manager-{uuid.uuid4().hex[:8]}@%h"], self._role_env(env, "fgpu-manager"))
        self._run("beat", [str(BIN / "celery"), "-A", "console", "beat", "--schedule",
                           str(self.work_dir / "beat-schedule"), "--loglevel", "INFO"], self._role_env(env, "fgpu-manager"))
        agent_env = {**env, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
        for node in self.nodes:
            node_dir = self.work_dir / "nodes" / node.name
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "mock-accelerator.toml").write_text(node.mock_toml)
            (node_dir / "agent.toml").write_text(node.agent_toml())
            node_env = {**agent_env, "FGPU_NODE_KEY": self.node_keys[node.name]} if self.node_keys else agent_env
            node_env = {**node_env, **(node.env or {})}
            self._run(self.agent_name(node.name), [*node.command_prefix, PYTHON, "manage.py", "agent", "--config",
                                                   str(node_dir / "agent.toml")],
                      self._role_env(node_env, f"fgpu-agent-{node.name}"))
        self._wait_for(self.web_answers, timeout=timeout, what="the web process to answer")
        self._wait_for(self.nodes_ready, timeout=timeout, what="every agent to register its node")

    def close(self) -> None:
        """Stop every process (SIGTERM, all at once, then SIGKILL what is left after 15 s) and kill
        what sessions left behind (processes whose allocation file lies under `work_dir`)."""
        current = list(self.procs.values())
        for proc in current:
            if proc.alive():
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in current:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill()
        for proc in self.history:
            if proc.alive():
                proc.kill()
        for pid in leftover_session_processes(self.work_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_agent_cgroups([node.name for node in self.nodes], self.work_dir)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- faults ------------------------------------------------------------------------------

    @staticmethod
    def agent_name(node: str) -> str:
        return f"agent-{node}"

    @property
    def agents(self) -> dict[str, Proc]:
        """Node name → its agent's current process."""
        return {node.name: self.procs[self.agent_name(node.name)] for node in self.nodes
                if self.agent_name(node.name) in self.procs}

    def kill(self, name: str) -> None:
        """SIGKILL process `name` and everything in its process group (a session's processes
        run in sessions of their own: an agent's sessions outlive it, as on a real node)."""
        self.procs[name].kill()

    def restart(self, name: str) -> Proc:
        """Start `name` again with the same command and environment (killing it first if it is
        still alive). Returns at once: the caller waits for what it needs (`web_answers`,
        `nodes_ready`, `redis_answers`)."""
        if self.procs[name].alive():
            self.procs[name].kill()
        argv, env = self._commands[name]
        return self._run(name, argv, env)

    def redis_stop(self) -> None:
        """Take the private broker down (SIGKILL: no persistence, its data is gone)."""
        assert self.private_redis, "only a private redis-server can be stopped"
        self.kill("redis")

    def redis_start(self, *, timeout: float = 20.0) -> None:
        """Bring the private broker back on the same port, empty; returns once it answers."""
        assert self.private_redis, "only a private redis-server can be started"
        self.restart("redis")
        self._wait_for(self.redis_answers, timeout=timeout, what="the private Redis to answer")

    def terminate_backends(self) -> int:
        """pg_terminate_backend every other connection to the stack's database (web, manager,
        beat, and the caller's other threads); returns how many were terminated."""
        import psycopg

        name = (self.database_url or self.env["DATABASE_URL"]).rsplit("/", 1)[1]
        admin_url = self.env["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin_url, autocommit=True) as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = %s AND pid <> pg_backend_pid()", [name]).fetchall()
        return sum(1 for (done,) in rows if done)

    # --- readiness ---------------------------------------------------------------------------

    def web_answers(self) -> bool:
        return web_answers(self.base)

    def redis_answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2).ping())
        except redis.RedisError:
            return False

    def nodes_ready(self) -> bool:
        """Every node ALIVE with all its devices; AssertionError when an agent process exited."""
        from django.db import connection

        from accelerators.models import Device, Node, NodeStatus

        exited = [name for name, proc in self.agents.items() if not proc.alive()]
        assert not exited, f"agent process(es) exited: {exited}"
        connection.close_if_unusable_or_obsolete()
        names = [node.name for node in self.nodes]
        alive = set(Node.objects.filter(name__in=names, status=NodeStatus.ALIVE).values_list("name", flat=True))
        counts = {}
        for node_name in Device.objects.filter(node__name__in=names).values_list("node__name", flat=True):
            counts[node_name] = counts.get(node_name, 0) + 1
        return all(node.name in alive and counts.get(node.name, 0) >= node.devices for node in self.nodes)

    def logs(self, *, tail: int = 4000) -> str:
        """The last `tail` characters of every process's log, restarts included."""
        return "".join(f"\n----- {proc.log_path.name} -----\n{proc.output()[-tail:]}" for proc in self.history)

    # --- internals ---------------------------------------------------------------------------

    def _import_settings_here(self) -> None:
        """The demo's slot formats and fractional settings imported (and with node_keys, the agents'
        keys made) through this process's own connection to the stack's database, Django's default
        one, as `_import_settings_in_a_process` does in a `manage.py shell` of its own: one Django
        start less before the web, manager and agents can start (1 s of CPU, 2-5 s on a loaded
        machine). The caller's writes must be committed for the processes to see them: under pytest
        the test is `django_db(transaction=True)`."""
        import io

        from django.core.management import call_command

        from accelerators.services import node_agent_key_rotate

        for path in (ROOT / "demo" / "mock-accelerator.toml", ROOT / "demo" / "accelerator.json"):
            call_command("import_accelerator_config", str(path), stdout=io.StringIO(), stderr=io.StringIO())
        if self.want_node_keys:
            self.node_keys = {node.name: node_agent_key_rotate(node_name=node.name) for node in self.nodes}

    def _import_settings_in_a_process(self, env: dict) -> None:
        """`_import_settings_here` in a `manage.py shell` given `env` (the stack's DATABASE_URL,
        another database than Django's default connection)."""
        script = ("from django.core.management import call_command\n"
                  f"call_command('import_accelerator_config', {str(ROOT / 'demo' / 'mock-accelerator.toml')!r})\n"
                  f"call_command('import_accelerator_config', {str(ROOT / 'demo' / 'accelerator.json')!r})\n")
        if self.want_node_keys:
            script += ("import json\nfrom accelerators.services import node_agent_key_rotate\n"
                       f"print('NODE-KEYS', json.dumps({{n: node_agent_key_rotate(node_name=n) for n in "
                       f"{[n.name for n in self.nodes]!r}}}))\n")
        out = subprocess.run([PYTHON, "manage.py", "shell", "-c", script], cwd=ROOT, env=env, capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise RuntimeError(f"import_accelerator_config failed:\n{out.stdout}{out.stderr}")
        for line in out.stdout.splitlines():
            if line.startswith("NODE-KEYS "):
                self.node_keys = json.loads(line.removeprefix("NODE-KEYS "))

    def _role_env(self, env: dict, user: str) -> dict:
        """`env` with REDIS_URL carrying `user`'s credentials, where the broker has ACL users."""
        if not self.broker_users:
            return env
        base = f"redis://{self.redis_address}:{self.redis_port}/0"
        return {**env, "REDIS_URL": self.broker_users[user].url(base)}

    def _run(self, name: str, argv: list[str], env: dict) -> Proc:
        self._commands[name] = (argv, env)
        runs = sum(1 for p in self.history if p.name == name)
        proc = Proc(name, argv, env=env, log_dir=self.work_dir, log_name=name if not runs else f"{name}.{runs}")
        self.procs[name] = proc
        self.history.append(proc)
        return proc

    def _wait_for(self, predicate: Callable, *, timeout: float, what: str) -> None:
        """wait_until, with every process's log in the failure (a fixture's setup failure shows
        no teardown output)."""
        try:
            wait_until(predicate, timeout=timeout, interval=0.2, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}{self.logs()}") from None


# --- sessions' processes, from /proc --------------------------------------------------------------

def _proc_environ(pid: str) -> list[bytes] | None:
    """A live (not zombie) process's environment, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except (OSError, IndexError):
        return None


def session_processes(session_ids: Iterable[str]) -> dict[str, list[int]]:
    """Session id → pids of live processes (not zombies) whose environment carries
    `FGPU_SESSION_ID=<id>` (every process a session starts, daemons that called setsid included;
    only one that rewrote its environment escapes). Sessions without any are left out."""
    markers = {f"FGPU_SESSION_ID={sid}".encode(): str(sid) for sid in session_ids}
    found: dict[str, list[int]] = {}
    own = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == own:
            continue
        environ = _proc_environ(entry.name)
        for var in environ or ():
            if var in markers:
                found.setdefault(markers[var], []).append(int(entry.name))
                break
    return found


def remove_agent_cgroups(nodes: Iterable[str], work_dir: Path) -> None:
    """Kill what the cgroups of the agents of `nodes` (run from `work_dir`: their scratch roots
    are `<work_dir>/nodes/<node>/scratches`) hold (their sessions' processes, also those that
    rewrote their environment) and remove them, in cgroup v2 and the v1 hierarchies: what an
    agent killed by a test leaves (agent.runtimes.SessionCgroups, parent_cgroup_name)."""
    from agent.limits import cgroup_v1_mounts
    from agent.runtimes import CGROUP_AUTO, cgroup2_root, cgroup_tag, parent_cgroup_name
    from tests.conftest import remove_cgroup_tree

    root, _ = cgroup2_root(CGROUP_AUTO)
    tops = sorted({*([root] if root is not None else []), *cgroup_v1_mounts().values()})
    for node in nodes:
        name = parent_cgroup_name(node, Path(work_dir) / "nodes" / node / "scratches", tag=cgroup_tag())
        for top in tops:
            if (top / name).is_dir():
                remove_cgroup_tree(top / name)


def leftover_session_processes(work_dir: Path) -> list[int]:
    """Pids of live processes of sessions run under `work_dir` (their FGPU_ALLOCATION names a
    file there): what to clean up after a run, whatever state the agents were left in."""
    prefix = f"FGPU_ALLOCATION={Path(work_dir).resolve()}/".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and any(var.startswith(prefix) for var in _proc_environ(entry.name) or ()):
            pids.append(int(entry.name))
    return pids
