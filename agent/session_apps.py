"""The agent's side of session apps (issue 16): start a web app a session's image declares
(JupyterLab, TensorBoard, …) inside the session on demand, wait until its port answers, and say
where it listens, so the console's proxy (sessions.serving.proxy) can reach it.

Messages (channel layer, on the session's `pty.<node>.<id>` group; the web: sessions.serving.session_apps):

- `pty.app_open` {app: {name, command, port, base_url}, base_url, token, keep, timeout, reply_channel}:
  start the app unless it runs with the token `keep` (idempotent: a second open of a running app
  answers at once, one of an app still starting waits for the same start); an app that runs with
  another token (the web no longer holds its token: `keep` is "" or differs) is stopped and started
  anew with `token` (the web's new random token; sessions.serving.session_apps). Answers `app.progress` {text} about once
  a second while it waits, then `app.ready` {host, port, reused} or `app.failed` {error, output}
  (its command exited, or its port did not answer within `timeout` seconds: it is killed; `output`
  is the last OUTPUT_TAIL_BYTES of what it wrote).
- `pty.app_status` {name, reply_channel}: `app.status` {running, host, port, error}.

The command runs beside the session as exec does (`SessionHandle.exec_popen`: the process
runtime's process with the session's environment and working directory; `docker exec` in the
session's container), through the session's shell, after `{host}`, `{port}`, `{base_url}` and
`{token}` are replaced (also exported as FGPU_APP_HOST, FGPU_APP_PORT, FGPU_APP_BASE_URL,
FGPU_APP_TOKEN). Where it listens: the process runtime gives it a free port on the agent's
`app_address` (agent.toml `[container] app-address`, default 127.0.0.1: an address the web hosts
reach); in a container it listens on its declared port on every address of the container, which
the node reaches at the container's address. It is one of the session's execs: it ends with the
session. An app that already answers on its declared port in a container the agent adopted after a
restart (it outlived the agent, as the container did) is taken as running (`Adopted`), not started
twice; `pty.app_status` carries the declared `port` for that. So is the app of a held process-runtime
session (agent.holder) in a sandbox with a network of its own: where it answered is recorded beside the
session's holder record (`<scratch root>/.holders/<id>.apps`, {name: port}; the agent's, out of the
session's reach), and the port is asked again in the session's network namespace, where only its own
processes listen. On the node's shared network a port could by then be another session's: such an app
is started anew instead.

The relay (docker runtime: agent.toml `[container] app-relay`, "auto" by default: on where
`app-address` is not a loopback address, i.e. the web hosts are other hosts, which cannot reach the
containers' bridge network; a sandboxed process-runtime session's app always): the agent relays
each app itself: a TCP listener of its own on a free port of `app-address` (the node's address the
web hosts reach), each connection piped both ways to the app at the container's address
(`relay_pipe`), closed with the session. The answers then name the relay's address and port, with
`relayed` (and, on a node without an agent key, the agent's random `relay_key`). Every connection
to a relay must first prove it comes from the web (protocol.app_relay: a line with an HMAC under
the node's relay key, naming the session and app): one that does not is closed before a byte
reaches the app, and logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.app_relay import HELLO_MAX_BYTES, HELLO_TIMEOUT_S, RelayGuard, RelayRefused

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 8 * 1024  # how much of a failed app's output its error carries
POLL_S = 0.2  # how often a starting app's port and exit are looked at
CONNECT_TIMEOUT_S = 1.0
PROGRESS_EVERY_S = 1.0


@dataclass
class AppProcess:
    """One app started in a session: its process (Popen, or DockerExec), where the node reaches
    it, its output file, and `ready`: a future that gets `{"ok": True}` once its port answered,
    or `{"ok": False, "error", "output"}`."""

    name: str
    process: Any  # Popen, or DockerExec
    host: str
    port: int
    output: object
    ready: asyncio.Future
    started: float = field(default_factory=time.monotonic)
    relay: asyncio.Server | None = None  # the agent's relay where agent.toml asks for one
    socket_in: Callable[[], socket.socket] | None = None  # a sandboxed session's: a new socket in its network namespace
    token: str | None = None  # the token it was started with (None: adopted, unknown)

    def reached_at(self) -> tuple[str, int]:
        """Where the web reaches the app: the relay's address, else the app's own."""
        if self.relay is not None:
            host, port = self.relay.sockets[0].getsockname()[:2]
            return host, port
        return self.host, self.port


class Adopted:
    """The process of an app found answering in a container or a held session's own network
    namespace (started by an earlier run of the agent): nothing to poll or signal; the session's
    end ends it. `answers` is checked again
    each time it is opened."""

    def poll(self) -> None:
        return None


def substitute(command: str, values: dict[str, str]) -> str:
    """`command` with each `{key}` of `values` replaced (other braces left as they are)."""
    for key, value in values.items():
        command = command.replace("{" + key + "}", value)
    return command


def free_port(address: str) -> int:
    """A TCP port nothing listens on at `address` now (the kernel's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def app_record(running) -> Path | None:
    """Where the apps of `running` that a later run of the agent can adopt are recorded: beside the
    held session's holder files (`<id>.apps` of agent.runtimes' `.holders`), for a session in a
    network namespace of its own; None otherwise (a session that ends with its agent, or on the
    node's network)."""
    exit_path = getattr(running.process, "exit_path", None)
    if exit_path is None or getattr(running.process, "app_socket", None) is None:
        return None
    return Path(exit_path).with_suffix(".apps")


def recorded_ports(path: Path) -> dict[str, int]:
    """Blocking: {app name: port} of an apps record; {} where it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(name): port for name, port in data.items() if isinstance(port, int) and 0 < port < 65536}


def record_port(path: Path, name: str, port: int) -> None:
    """Blocking: add app `name` at `port` to the apps record at `path` (written whole, then renamed)."""
    ports = recorded_ports(path)
    ports[name] = port
    partial = path.with_suffix(".apps-new")
    partial.write_text(json.dumps(ports))
    os.replace(partial, path)


def output_tail(output) -> str:
    """The last OUTPUT_TAIL_BYTES of an app's output file, as text."""
    try:
        output.flush()
        size = output.seek(0, 2)
        output.seek(max(0, size - OUTPUT_TAIL_BYTES))
        return output.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


class SessionApps:
    """The apps of one agent's sessions. `agent`: the Agent (its loop, pools, channel layer,
    runtime, `app_address`); each RunningSession keeps its own in `running.apps` (name → AppProcess)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        guard = getattr(agent, "guard", None)
        self.relay_guard = RelayGuard.for_node(node=str(agent.node), node_key=getattr(guard, "key", "") or "")

    def handle(self, running, message: dict) -> None:
        """A `pty.app_open` or `pty.app_status` message for `running` (on the agent's loop)."""
        if message.get("type") == "pty.app_open":
            self.agent._in_background(self._open(running, message))
        else:
            self.agent._in_background(self._status(running, message))

    async def _reply(self, message: dict, answer: dict) -> None:
        try:
            await self.agent.layer.send(message["reply_channel"], self.agent.guard.answer(answer))  # sealed: protocol.channel
        except Exception:
            log.warning("agent %s: could not answer an app message", self.agent.node, exc_info=True)

    async def _status(self, running, message: dict) -> None:
        app = running.apps.get(str(message.get("name")))
        if app is None:
            app = await self._adopt(running, str(message.get("name")), int(message.get("port") or 0))
        if app is None:
            answer = {"running": False, "error": "it has not been started in this session"}
        else:
            code = await self.agent._in(self.agent._work, app.process.poll)
            if code is not None:
                answer = {"running": False, "error": f"it exited with code {code if code >= 0 else 128 - code}"}
            elif not app.ready.done():
                answer = {"running": False, "error": "it is still starting"}
            elif not app.ready.result()["ok"]:
                answer = {"running": False, "error": app.ready.result()["error"]}
            else:
                answer = {"running": True, **await self._relayed(running, app)}
        await self._reply(message, {"type": "app.status", **answer})

    async def _open(self, running, message: dict) -> None:
        spec, timeout = message["app"], float(message.get("timeout") or 60)
        name = str(spec["name"])
        try:
            app, reused = await self._ensure(running, message)
        except Exception as exc:
            log.info("agent %s: app %s of session %s could not start: %s", self.agent.node, name, running.session_id, exc)
            await self._reply(message, {"type": "app.failed", "error": f"{name} could not be started: {exc}", "output": ""})
            return
        while not app.ready.done():
            waited = int(time.monotonic() - app.started)
            await self._reply(
                message,
                {
                    "type": "app.progress",
                    "text": f"starting {name}: waiting for it to answer on port {app.port} ({waited} s of {timeout:g} s)",
                },
            )
            await asyncio.wait([app.ready], timeout=PROGRESS_EVERY_S)
        result = app.ready.result()
        if result["ok"]:
            await self._reply(message, {"type": "app.ready", **await self._relayed(running, app), "reused": reused})
        else:
            await self._reply(message, {"type": "app.failed", "error": result["error"], "output": result["output"]})

    async def _relayed(self, running, app: AppProcess) -> dict:
        """Where the web reaches a running `app`, `{host, port}`: through the agent's relay
        (started now if it is not listening yet; with `relayed` and maybe `relay_key`:
        protocol.app_relay) for a container's app where agent.toml's `app-relay` is on and for a
        sandboxed session's app (it listens on the loopback of the session's own network
        namespace, reached through `socket_in`), else at the app's own address."""
        relayed = getattr(self.agent, "app_relay", False) and getattr(running.process, "app_address", None) is not None
        if not relayed and app.socket_in is None:
            return {"host": app.host, "port": app.port}
        if app.relay is None:
            target, socket_in = (app.host, app.port), app.socket_in
            guard, session_id, name = self.relay_guard, str(running.session_id), app.name

            def proof(line: bytes) -> None:
                guard.check(line, session_id=session_id, app=name)

            app.relay = await asyncio.start_server(
                lambda r, w: relay_pipe(r, w, target, socket_in=socket_in, proof=proof, node=str(self.agent.node)),
                host=self.agent.app_address,
                port=0,
            )
            running.relays.append(app.relay)
            log.info(
                "agent %s: relaying app %s of session %s from %s:%d to %s:%d",
                self.agent.node,
                app.name,
                running.session_id,
                *app.reached_at(),
                *target,
            )
        host, port = app.reached_at()
        return {"host": host, "port": port, **self.relay_guard.answer_fields()}

    @staticmethod
    def close_relays(running) -> None:
        """Stop relaying `running`'s apps (its session ended): no new connection is taken and the
        open ones end."""
        for server in running.relays:
            server.close()
            close_clients = getattr(server, "close_clients", None)  # Python 3.13+
            if close_clients is not None:
                close_clients()
        running.relays.clear()

    async def _ensure(self, running, message: dict) -> tuple[AppProcess, bool]:
        """The app running (or starting) in `running`, started now unless it runs: (app, reused)."""
        spec = message["app"]
        name = str(spec["name"])
        keep = str(message.get("keep") or "")
        current = running.apps.get(name)
        if current is not None and isinstance(current.process, Adopted) and current.token is None and keep:
            current.token = keep  # adopted after a restart: it runs with the token the web still holds
        if current is not None and current.token != keep and not isinstance(current.process, Adopted):
            log.info(
                "agent %s: app %s of session %s runs with a token the console no longer holds: started anew",
                self.agent.node,
                name,
                running.session_id,
            )
            await self._stop(running, current)
            running.apps.pop(name, None)
            current = None
        if (
            current is not None
            and current.relay is not None
            and (
                await self.agent._in(self.agent._work, current.process.poll) is not None
                or not await _answers(current.host, current.port, current.socket_in)
            )
        ):
            current.relay.close()  # the app went away: its relay too (a new start gets a new one)
            current.relay = None
        if current is not None and isinstance(current.process, Adopted):
            if await _answers(current.host, current.port, current.socket_in):
                if current.token is None:
                    raise RuntimeError(
                        "it runs since before the agent restarted, with a token the console no longer holds; "
                        "end the session and start a new one to use it"
                    )
                return current, True
            running.apps.pop(name, None)  # it went away: start it again
            current = None
        if current is not None:
            ended = current.ready.done() and not current.ready.result()["ok"]
            if not ended and await self.agent._in(self.agent._work, current.process.poll) is None:
                return current, current.ready.done()
            running.apps.pop(name, None)
        adopted = await self._adopt(running, name, int(spec["port"]))
        if adopted is not None:
            if not keep:
                running.apps.pop(name, None)
                raise RuntimeError(
                    "it runs since before the agent restarted, with a token the console no longer holds; "
                    "end the session and start a new one to use it"
                )
            adopted.token = keep
            return adopted, True
        app = await self.agent._in(self.agent._work, self._spawn, running, message)
        running.apps[name] = app
        self.agent._in_background(self._watch(running, app, float(message.get("timeout") or 60)))
        return app, False

    async def _stop(self, running, app: AppProcess) -> None:
        """Stop `app` (to start it again with a new token): its command and what it started are
        killed and waited for (so its port is free), its relay closed."""
        if app.relay is not None:
            app.relay.close()
            app.relay = None
        await self.agent._in(self.agent._work, running.process.signal_exec, app.process, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while await self.agent._in(self.agent._work, app.process.poll) is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        running.execs.discard(app.process)  # a start still waited for ends as exited (_watch)

    async def _adopt(self, running, name: str, port: int) -> AppProcess | None:
        """The app `name` that outlived an earlier run of the agent, taken as running where it
        answers: in a container, on its declared `port`; in a held session's own network namespace,
        on the port its apps record names (app_record). Else None (always on the node's shared
        network, where the agent picks ports and one could now be another session's)."""
        address = getattr(running.process, "app_address", None)
        record = app_record(running)
        if address is not None and port:
            try:
                _, host = await self.agent._in(self.agent._work, address)
            except Exception:
                return None
            socket_in = None
        elif address is None and record is not None:
            port = (await self.agent._in(self.agent._work, recorded_ports, record)).get(name, 0)
            host, socket_in = "127.0.0.1", running.process.app_socket
        else:
            return None
        if not port or not await _answers(host, port, socket_in):
            return None
        ready = self.agent.loop.create_future()
        ready.set_result({"ok": True})
        app = running.apps[name] = AppProcess(
            name=name, process=Adopted(), host=host, port=port, output=None, ready=ready, socket_in=socket_in
        )
        log.info(
            "agent %s: app %s of session %s answers on %s:%d already; adopted",
            self.agent.node,
            name,
            running.session_id,
            host,
            port,
        )
        return app

    def _spawn(self, running, message: dict) -> AppProcess:
        """Blocking (a worker thread): start the app's command beside the session."""
        spec = message["app"]
        address = getattr(running.process, "app_address", None)
        if address is not None:  # in a container: its declared port, on the container's address
            bind, host = address()
            port = int(spec["port"])
        elif (socket_in := getattr(running.process, "app_socket", None)) is not None:
            # a sandbox with a network of its own: its loopback, a port free there (the agent relays it)
            bind = host = "127.0.0.1"
            with socket_in() as probe:
                probe.bind((bind, 0))
                port = probe.getsockname()[1]
        else:  # the process runtime on the node's network, shared by every session: a free port
            bind = host = self.agent.app_address
            port = free_port(bind)
        values = {"host": bind, "port": str(port), "base_url": str(message["base_url"]), "token": str(message["token"])}
        exports = " ".join(f"FGPU_APP_{key.upper()}='{value}'" for key, value in values.items())
        command = f"export {exports}; {substitute(str(spec['command']), values)}"
        output = tempfile.TemporaryFile()
        shell = self.agent.runtime.shell()
        process = running.process.exec_popen([shell, "-c", command], stdout=output, stderr=output)
        running.execs.add(process)  # killed with the session
        log.info("agent %s: started app %s of session %s on %s:%d", self.agent.node, spec["name"], running.session_id, host, port)
        return AppProcess(
            name=str(spec["name"]),
            process=process,
            host=host,
            port=port,
            output=output,
            ready=self.agent.loop.create_future(),
            token=str(message["token"]),
            socket_in=getattr(running.process, "app_socket", None) if address is None else None,
        )

    async def _watch(self, running, app: AppProcess, timeout: float) -> None:
        """Wait until the app's port answers (ready), its command exits, or `timeout` passes (it
        is killed); then, once it runs, until it exits (to forget it)."""
        deadline = app.started + timeout
        while True:
            code = await self.agent._in(self.agent._work, app.process.poll)
            if code is not None:
                code = code if code >= 0 else 128 - code
                app.ready.set_result(
                    {
                        "ok": False,
                        "output": output_tail(app.output),
                        "error": f"{app.name} exited with code {code} before it answered on port {app.port}",
                    }
                )
                running.execs.discard(app.process)
                return
            if await _answers(app.host, app.port, app.socket_in):
                app.ready.set_result({"ok": True})
                if (record := app_record(running)) is not None:  # for the agent's next run to adopt
                    try:
                        await self.agent._in(self.agent._work, record_port, record, app.name, app.port)
                    except OSError as exc:
                        log.warning("agent %s: app %s's port could not be recorded: %s", self.agent.node, app.name, exc)
                return
            if time.monotonic() >= deadline:
                await self.agent._in(self.agent._work, running.process.signal_exec, app.process, signal.SIGKILL)
                running.execs.discard(app.process)
                app.ready.set_result(
                    {
                        "ok": False,
                        "output": output_tail(app.output),
                        "error": f"{app.name} did not answer on port {app.port} within {timeout:g} s and was stopped",
                    }
                )
                return
            await asyncio.sleep(POLL_S)


RELAY_CHUNK = 64 * 1024  # bytes read at a time on either side of a relayed connection


async def relay_pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    target: tuple[str, int],
    *,
    socket_in=None,
    proof: Callable[[bytes], None] | None = None,
    node: str = "",
) -> None:
    """One relayed connection: `proof(first line)` (protocol.app_relay's RelayGuard.check: raises
    RelayRefused) accepts the connection's first line within HELLO_TIMEOUT_S, else it is closed
    (logged) before anything reaches the app; then connect to `target` (the app in its container,
    or on a sandbox's loopback through `socket_in`, `_connect`) and copy bytes both ways until
    either side ends (each direction's end passed on as a half-close), then close both.
    Backpressure: a side that does not read stops the other from being read (drain)."""
    if proof is not None:
        peer = writer.get_extra_info("peername")
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout=HELLO_TIMEOUT_S)
            if len(line) > HELLO_MAX_BYTES:
                raise RelayRefused("its first line is too long")
            proof(line)
        except (RelayRefused, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError) as exc:
            why = exc if isinstance(exc, RelayRefused) else "no relay proof"
            log.warning("agent %s: refused a connection to an app relay from %s: %s", node, peer, why)
            writer.close()
            return
    try:
        up_reader, up_writer = await _connect(*target, socket_in, timeout=CONNECT_TIMEOUT_S * 5)
    except (OSError, TimeoutError):
        writer.close()
        return

    async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while chunk := await source.read(RELAY_CHUNK):
                sink.write(chunk)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()
        except (OSError, ConnectionError):
            sink.close()

    try:
        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
    finally:
        for side in (writer, up_writer):
            side.close()


async def _connect(host: str, port: int, socket_in, *, timeout: float):
    """A stream connection to host:port (reader, writer): on the agent's network, or with
    `socket_in` (a blocking function that makes a socket in a sandboxed session's network
    namespace, agent.sandbox.netns_socket; run on a worker thread) on the session's. Raises
    OSError, TimeoutError."""
    if socket_in is None:
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout=timeout)
    sock = await asyncio.to_thread(socket_in)
    try:
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout=timeout)
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def _answers(host: str, port: int, socket_in=None) -> bool:
    """Whether something accepts TCP connections at host:port (in a sandboxed session's network
    namespace with `socket_in`: `_connect`)."""
    try:
        _, writer = await _connect(host, port, socket_in, timeout=CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True
