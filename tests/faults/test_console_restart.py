"""`make run` restarted with sessions running (issue 33, item 7): they keep running and their
terminals reattach. The console (`manage.py standalone`, the process runtime, its SQLite and
sessions under one data dir) runs a shell session launched through the REST API; the test types
into its terminal, stops the console (SIGTERM: a graceful stop, which now leaves held sessions
running, as a kubelet's restart leaves its pods; or SIGKILL), lets the session write while no
console runs, and starts the console again on the same data dir. The session is still RUNNING,
its leader the same process (the holder's record, and the shell's own `$$`), its terminal shows
what was written before and during the absence, and input echoes; DELETE then ends it and leaves
no process, holder or cgroup behind. With FGPU_STOP_SESSIONS_ON_EXIT=true a graceful stop ends
every session (holder included) as it did before.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import websockets

from agent.runtimes import HOLDERS_DIR
from tests.stack import ApiClient, Proc, Stack, StackNode, free_port, mock_inventory, wait_until
from tests.test_browser import answers

pytestmark = pytest.mark.e2e

PASSWORD = "restart-test-password"
NODE = "demo-node"  # demo/agent.toml's
IN_HOME = "while [ ! -e go ]; do sleep 0.05; done; echo during-$((40 + 2)); : > said"  # "during-42" once `go` exists


class Console:
    """A standalone console on `data_dir` and `port`, started again by `start()`."""

    def __init__(self, tmp_path: Path, *, stop_sessions: bool = False, cgroup_root: str | None = None,
                 network: str | None = None):
        self.tmp_path, self.data_dir, self.port = tmp_path, tmp_path / "data", free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
        self.env.update(FGPU_DATA_DIR=str(self.data_dir), FGPU_ADMIN_PASSWORD=PASSWORD, PORT=str(self.port),
                        PYTHONUNBUFFERED="1", FGPU_RUNTIME="process", FGPU_STOP_SESSIONS_ON_EXIT=str(stop_sessions).lower())
        if cgroup_root is not None or network is not None:  # the demo node, with these [container] settings
            demo = Path(__file__).resolve().parents[2] / "demo"
            (tmp_path / "mock-accelerator.toml").write_text((demo / "mock-accelerator.toml").read_text())
            toml = (demo / "agent.toml").read_text() + "\n[container]\n"
            toml += f'cgroup-root = "{cgroup_root}"\n' if cgroup_root is not None else ""
            toml += f'network = "{network}"\n' if network is not None else ""
            (tmp_path / "agent.toml").write_text(toml)
            self.env["FGPU_AGENT_CONFIG"] = str(tmp_path / "agent.toml")
        self.proc: Proc | None = None
        self.starts = 0

    def start(self) -> Console:
        self.starts += 1
        self.proc = Proc(f"standalone-{self.starts}", [sys.executable, "manage.py", "standalone"], env=self.env,
                         log_dir=self.tmp_path)
        proc = self.proc

        def ready() -> bool:
            assert proc.alive(), f"standalone exited:\n{proc.output()}"
            return "fGPU Console is serving on" in proc.output() and answers(self.base + "/login/")

        wait_until(ready, timeout=90, interval=0.2, what="the standalone console to serve /login/")
        return self

    def stop(self, sig: int) -> str:
        """Stop the console with `sig` (to its process group: its sessions run in sessions of their
        own); its output."""
        assert self.proc is not None
        if sig == signal.SIGKILL:
            self.proc.kill()
        else:
            self.proc.signal(sig)
            self.proc.popen.wait(timeout=60)
            self.proc.kill()  # reaps, closes the log; the group is empty by now
        return self.proc.output()

    def token(self) -> str:
        request = urllib.request.Request(self.base + "/api/v1/auth/token/", method="POST",
                                         data=json.dumps({"username": "admin", "password": PASSWORD}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read())["token"]

    def holders(self) -> Path:
        return self.data_dir / "sessions" / NODE / HOLDERS_DIR


@pytest.fixture
def console(tmp_path, request):
    """`console(stop_sessions=False)` → a started Console; at the end, a console with
    FGPU_STOP_SESSIONS_ON_EXIT=true started and stopped on the same data dir where held sessions
    are left (a failed test's): it adopts and ends them."""
    made: list[Console] = []

    def make(**options) -> Console:
        made.append(Console(tmp_path, **options))
        return made[-1].start()

    yield make
    for started in made:
        report = getattr(request.node, "rep_call", None)
        if started.proc is not None and (report is None or report.failed):
            sys.stderr.write(f"\n----- {started.proc.name} log -----\n{started.proc.output()[-8000:]}\n")
        if started.proc is not None and started.proc.alive():
            started.stop(signal.SIGTERM)
        if any(started.holders().glob("*.json")):
            started.env["FGPU_STOP_SESSIONS_ON_EXIT"] = "true"
            started.start().stop(signal.SIGTERM)


class Terminal:
    """A session's terminal websocket, as the page opens it (a ticket, then /ws/…/terminal/)."""

    def __init__(self, console: Console | Stack, client: ApiClient, session_id: str):
        status, ticket = client.call("POST", f"/api/v1/sessions/{session_id}/terminal-ticket/")
        assert status == 200, ticket
        self.url = f"ws://127.0.0.1:{console.port}{ticket['url']}"
        self.output = ""

    async def run(self, typed: list[str], wanted: list[str], *, timeout: float = 30) -> str:
        """Open it, type each of `typed`, and read until every one of `wanted` is in what it shows."""
        async with websockets.connect(self.url) as ws:
            for line in typed:
                await ws.send(json.dumps({"type": "input", "data": line + "\r"}))
            async with asyncio.timeout(timeout):
                while not all(word in self.output for word in wanted):
                    frame = json.loads(await ws.recv())
                    assert frame["type"] == "output", (frame, self.output[-2000:])
                    self.output += frame["data"]
        return self.output


def status_of(client: ApiClient, session_id: str) -> dict:
    status, body = client.call("GET", f"/api/v1/sessions/{session_id}/")
    assert status == 200, body
    return body


def wait_status(client: ApiClient, session_id: str, wanted: str, *, timeout: float, what: str) -> None:
    wait_until(lambda: status_of(client, session_id)["status"] == wanted, timeout=timeout, what=what)


def launch_running(client: ApiClient, name: str) -> str:
    """Launch a shell of 0.5 fGPU named `name`; its id once it is RUNNING."""
    status, body = client.launch(name, {"resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "256M"}})
    assert status == 201, body
    wait_status(client, body["id"], "RUNNING", timeout=60, what="the session to be RUNNING")
    return body["id"]


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def cgroups_of(session_id: str) -> list[str]:
    """The cgroup directories named after the session (its own and its holder's), in every hierarchy."""
    found = []
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(top, d) for d in dirs if d.endswith(session_id)]
    return found


@pytest.mark.parametrize(("sig", "cgroup_root"), [(signal.SIGTERM, None), (signal.SIGKILL, None), (signal.SIGTERM, "none")],
                         ids=["sigterm", "kill-9", "sigterm-scan"])
def test_a_restarted_console_finds_its_session_running_with_the_same_leader_and_its_terminal_reattaches(console, sig,
                                                                                                        cgroup_root):
    first = console(cgroup_root=cgroup_root)
    client = ApiClient(first.base, first.token())
    session_id = launch_running(client, "kept")
    before = asyncio.run(Terminal(first, client, session_id).run(
        ["echo before-$((40 + 2)) shell-$$", f"({IN_HOME}) &"], ["before-42 shell-"]))
    shell = before.split("before-42 shell-")[1].split()[0]
    record = json.loads((first.holders() / f"{session_id}.json").read_text())
    assert running(record["pid"]) and running(record["holder_pid"])

    said = first.stop(sig)
    if sig == signal.SIGTERM:
        assert "1 session keeps running; the next start adopts it" in said, said[-3000:]
    assert running(record["pid"]) and running(record["holder_pid"]), "the session ended with the console"
    home = Path(record["work_dir"])
    (home / "go").touch()  # the session writes while no console runs
    wait_until(lambda: (home / "said").exists(), timeout=10, what="the session to write while no console runs")

    second = first.start()  # the same data dir and port
    client = ApiClient(second.base, second.token())
    answer = status_of(client, session_id)
    assert answer["status"] == "RUNNING", answer
    assert json.loads((second.holders() / f"{session_id}.json").read_text())["pid"] == record["pid"]
    assert running(record["pid"])
    after = asyncio.run(Terminal(second, client, session_id).run(
        ["echo again-$((40 + 2)) shell-$$"], ["before-42", "during-42", f"again-42 shell-{shell}"]))
    assert after.index("before-42") < after.index("during-42") < after.index("again-42")  # the scrollback, in order
    assert status_of(client, session_id)["status"] == "RUNNING"
    # Its slice is still its own: a session that needs the whole GPU waits for it, and gets it once it ends.
    status, whole = client.launch("whole", {"resources": {"cuda.shares": "2", "cpu": 1, "mem": "256M"}})
    assert status == 201, whole
    wait_until(lambda: status_of(client, whole["id"])["status_reason"], timeout=30,
               what="a scheduling pass to say why the whole GPU waits")
    assert status_of(client, whole["id"])["status"] == "PENDING"

    status, _ = client.delete(session_id)
    assert status in (200, 202, 204), status
    wait_status(client, session_id, "TERMINATED", timeout=60, what="the session to end")
    wait_status(client, whole["id"], "RUNNING", timeout=60, what="the whole GPU to be granted once the session ended")
    assert client.delete(whole["id"])[0] in (200, 202, 204)
    wait_status(client, whole["id"], "TERMINATED", timeout=60, what="the second session to end")
    wait_until(lambda: not running(record["pid"]) and not running(record["holder_pid"]), timeout=20,
               what="its leader and holder to end")
    assert not list(second.holders().glob(f"{session_id}*")), "the holder's socket or records are left"
    assert cgroups_of(session_id) == []


@pytest.mark.parametrize("cgroup_root", [None, "none"], ids=["cgroup", "scan"])
def test_a_console_told_to_stop_sessions_on_exit_ends_them_holder_included(console, cgroup_root):
    first = console(stop_sessions=True, cgroup_root=cgroup_root)
    client = ApiClient(first.base, first.token())
    session_id = launch_running(client, "ended")
    record = json.loads((first.holders() / f"{session_id}.json").read_text())

    said = first.stop(signal.SIGTERM)
    assert "keep running" not in said, said[-3000:]
    wait_until(lambda: not running(record["pid"]) and not running(record["holder_pid"]), timeout=10,
               what="its leader and holder to end")
    assert cgroups_of(session_id) == []


def pipes(pid: int) -> set[str]:
    """The pipes process `pid` holds open ("pipe:[inode]")."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            found.add(link)
    return found


def slirp_of(holder_pid: int) -> int:
    """The slirp4netns of the session whose holder is `holder_pid`: the one whose --exit-fd is a
    pipe the holder holds the other end of."""
    held = pipes(holder_pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and Path(f"/proc/{entry}/comm").exists():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if comm == "slirp4netns" and pipes(int(entry)) & held:
                return int(entry)
    raise AssertionError(f"no slirp4netns shares a pipe with holder {holder_pid}")


def test_an_adopted_outbound_sessions_slirp4netns_runs_on_and_ends_with_it(console):
    """The outbound network's slirp4netns, started by the first console's agent, is no child of
    the next one: it ends when the session's holder does (its --exit-fd), at the session's DELETE."""
    first = console(network="outbound")
    client = ApiClient(first.base, first.token())
    session_id = launch_running(client, "outbound")
    record = json.loads((first.holders() / f"{session_id}.json").read_text())
    slirp = slirp_of(record["holder_pid"])

    first.stop(signal.SIGTERM)
    second = first.start()
    client = ApiClient(second.base, second.token())
    assert status_of(client, session_id)["status"] == "RUNNING"
    assert running(slirp), "the session's network ended with the console"
    assert client.delete(session_id)[0] in (200, 202, 204)
    wait_status(client, session_id, "TERMINATED", timeout=60, what="the session to end")
    wait_until(lambda: not running(slirp), timeout=10, what="its slirp4netns to end")


def heartbeat_after(node: str, since: float) -> bool:
    """Whether `node`'s last heartbeat came after `since` (epoch seconds)."""
    from django.db import connection

    from accelerators.models import Node

    connection.close_if_unusable_or_obsolete()
    beat = Node.objects.get(name=node).last_heartbeat
    return beat is not None and beat.timestamp() > since


@pytest.mark.django_db(transaction=True)
def test_a_gracefully_stopped_agent_leaves_its_session_running_and_its_next_start_adopts_it(tmp_path, alice_token):
    """The distributed agent (`manage.py agent`, SIGTERM as systemd stops it): its session runs on
    while no agent does, and the agent started again adopts it, its terminal included."""
    stack = Stack(nodes=[StackNode("kept-node", mock_inventory(gpus=1), devices=1, scratch_retention=0)],
                  work_dir=tmp_path / "stack", env={"FGPU_STOP_SESSIONS_ON_EXIT": "false", "FGPU_HEARTBEAT_TIMEOUT": "60"})
    try:
        stack.start()
        client = ApiClient(stack.base, alice_token)
        session_id = launch_running(client, "kept")
        asyncio.run(Terminal(stack, client, session_id).run([f"({IN_HOME}) &", "echo before-$((40 + 2))"], ["before-42"]))
        holders = tmp_path / "stack" / "nodes" / "kept-node" / "scratches" / HOLDERS_DIR
        record = json.loads((holders / f"{session_id}.json").read_text())

        agent = stack.agents["kept-node"]
        agent.signal(signal.SIGTERM)
        agent.popen.wait(timeout=60)
        assert "kept-node: 1 session(s) keep running; the next start adopts them" in agent.output(), agent.output()[-3000:]
        assert running(record["pid"]) and running(record["holder_pid"]), "the session ended with its agent"
        (Path(record["work_dir"]) / "go").touch()
        wait_until(lambda: (Path(record["work_dir"]) / "said").exists(), timeout=10, what="the session to write")

        restarted = time.time()
        stack.restart(stack.agent_name("kept-node"))
        wait_until(lambda: heartbeat_after("kept-node", restarted), timeout=60, what="the restarted agent's heartbeat")
        assert status_of(client, session_id)["status"] == "RUNNING"
        after = asyncio.run(Terminal(stack, client, session_id).run(["echo again-$((40 + 2))"], ["during-42", "again-42"]))
        assert after.index("before-42") < after.index("during-42") < after.index("again-42")
        assert running(record["pid"])
        assert client.delete(session_id)[0] in (200, 202, 204)
        wait_status(client, session_id, "TERMINATED", timeout=60, what="the session to end")
        wait_until(lambda: not running(record["pid"]) and not running(record["holder_pid"]), timeout=20,
                   what="its leader and holder to end")
    finally:
        stack.close()


def test_the_scratch_sweep_spares_the_holders_directory(tmp_path):
    """The sockets and records held sessions are adopted by outlive every scratch-retention (0 s too)."""
    from agent.lifecycle import sweep_scratch

    root = tmp_path / "scratch"
    (root / HOLDERS_DIR).mkdir(parents=True)
    (root / "ended").mkdir()
    assert sweep_scratch(root, keep=set(), older_than_s=-1) == 1
    assert [p.name for p in root.iterdir()] == [HOLDERS_DIR]


@pytest.mark.parametrize("hold", [True, False], ids=["held", "unheld"])
def test_a_graceful_stop_keeps_held_sessions_and_stops_unheld_ones(tmp_path, hold):
    """Agent.shutdown(keep_sessions=True): a held session runs on (counted, nothing reported) and the
    next start adopts it; an unheld one, whose PTY is the agent's own, is stopped and reported
    TERMINATED, as every session was before."""
    from tests.test_agent_runtime import Harness, run_agent, start_spec

    node = f"graceful-{os.getpid()}-{int(hold)}"
    spec = {**start_spec(command="exec sleep 600"), "owner_is_staff": False, "devices": []}
    session_id = spec["session_id"]
    seen: dict = {}

    async def stop_gracefully(h: Harness):
        await h.start_session(spec)
        seen["pid"] = h.agent.sessions[session_id].process.pid
        seen["kept"] = await h.agent.shutdown(keep_sessions=True)
        seen["reports"] = [status for status, _, _ in h.manager.reports_for(session_id)]

    run_agent(tmp_path, stop_gracefully, node=node, runtime_options={"hold": hold})
    if not hold:
        assert (seen["kept"], seen["reports"][-1]) == (0, "TERMINATED")
        wait_until(lambda: not running(seen["pid"]), timeout=10, what="the unheld session to end")
        return
    assert (seen["kept"], seen["reports"][-1]) == (1, "RUNNING")
    assert running(seen["pid"])

    async def adopt(h: Harness):
        assert session_id in h.agent.sessions, "the next start did not adopt the held session"
        assert h.agent.sessions[session_id].process.pid == seen["pid"]

    run_agent(tmp_path, adopt, node=node, runtime_options={"hold": True})  # its shutdown() stops it
    wait_until(lambda: not running(seen["pid"]), timeout=10, what="the adopted session to end")
