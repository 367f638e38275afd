"""The `docker` runtime: one Docker container per session, through the Docker SDK for Python.

Each session runs in its own container from its image (its start spec's `image`, else agent.toml's
`[container] default-image`), as Backend.AI runs a kernel: named `fgpu-<session id>` and
labelled `fgpu.session` / `fgpu.node` / `fgpu.work-dir`, its terminal the container's TTY
(attached before it starts, so no output is missed), `docker-init` as PID 1 so signals reach the
shell. Isolation and limits: the session's working directory mounted read-write as its home
(`/home/work`), the virtual nvidia-smi and the allocation document read-only at `/opt/fgpu`,
`cpu` → `nano_cpus`, `mem` → `mem_limit` with swap off, a pids limit, every capability dropped,
`no-new-privileges`, a non-root user (agent.toml `uid`), no Docker socket, the network of
agent.toml (`outbound`: the agent's own network, guarded so that sessions reach neither each
other nor the node, link-local or private addresses, agent.network; or `none`). On a CUDA node
the granted devices (or MIG devices) are asked for by UUID through the NVIDIA container
toolkit (`DeviceRequest`); a mock node asks for none.
A fraction is enforced where agent.toml says how: `hami-core` mounts HAMi-core's libvgpu.so
read-only at HAMI_CORE_PATH and preloads it (`LD_PRELOAD`; it reads the contract's
`CUDA_DEVICE_MEMORY_LIMIT_<i>` and `CUDA_DEVICE_SM_LIMIT`, as HAMi's device plugin arranges);
`mps = true` mounts the node's MPS pipe directory, names it in `CUDA_MPS_PIPE_DIRECTORY` and
shares the host's IPC namespace, which the MPS client needs (NVIDIA's MPS documentation).

Ending: the container is stopped (SIGHUP/SIGTERM, then SIGKILL, which ends every process of
its PID namespace) and removed with its anonymous volumes; an out-of-memory kill ends the
session with the reason in words. An agent that starts again finds its containers by label:
running ones are adopted (terminal, exec, logs and stop work on), ended ones removed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import protocol
from protocol.messages import StartSpec
from protocol.units import format_binary_size
from agent.mounts import NO_FOLDERS, Folders
from agent.network import OUTBOUND, NetworkError, SessionNetwork, instance_id, network_mode
from agent.limits import SessionLimits, docker_parent_open, docker_parent_remove
from agent.runtimes import DOCKER, SessionPaths, cgroup_tag, parent_cgroup_name

log = logging.getLogger(__name__)

HOME = "/home/work"
TOOLS = "/opt/fgpu"
PATH = "/opt/fgpu/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PIDS_LIMIT = 4096
STOP_GRACE_S = 3
LABEL_SESSION, LABEL_NODE, LABEL_WORK_DIR = "fgpu.session", "fgpu.node", "fgpu.work-dir"
# The agent installation that made a container (agent.network.instance_id of its scratch root): two
# consoles on one host whose nodes share a name (both `make run`'s demo-node) leave each other's alone.
LABEL_INSTANCE = "fgpu.instance"
HAMI_CORE_PATH = "/usr/local/vgpu/libvgpu.so"  # where HAMi's device plugin mounts it too
PULL_PROGRESS_S = 1.0  # at most one progress report a second while an image is pulled


def _split_reference(reference: str) -> tuple[str, str | None]:
    """("repository", "tag") of an image reference; a digest stays in the repository part
    (`repo@sha256:…`, tag None); no tag means "latest", as `docker pull` takes it."""
    if "@" in reference:
        return reference, None
    name, _, tag = reference.rpartition(":")
    if name and "/" not in tag:
        return name, tag
    return reference, "latest"


def docker_engine_where() -> str:
    """Where the Docker SDK looks for Docker Engine: DOCKER_HOST, else the local socket."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def docker_engine_probe(*, timeout_s: float = 3.0):
    """Blocking, at most about `timeout_s` seconds: `(client, "")` when Docker Engine answers a
    ping at docker_engine_where() (client: a docker.DockerClient with that timeout), else
    `(None, why)` with the SDK's or the engine's words (no socket, permission denied, timed out)."""
    try:
        import docker

        client = docker.from_env(timeout=max(1, round(timeout_s)))
        client.ping()
        return client, ""
    except Exception as exc:  # no SDK, no socket, no permission, no answer: all mean "not here"
        return None, " ".join(str(exc).split()) or type(exc).__name__


def docker_image_present(client, reference: str) -> bool:
    """Blocking: whether Docker Engine holds image `reference` (a tag or digest) locally."""
    import docker

    try:
        client.images.get(reference)
        return True
    except docker.errors.ImageNotFound:
        return False


class DockerRuntimeError(RuntimeError):
    """Docker could not do what a session needs; the message says what, in Docker's words."""


class DockerSession:
    """A session's container, as the agent drives it (the interface of runtimes.SessionHandle)."""

    def __init__(
        self, runtime: "DockerRuntime", container, stream: socket.socket, *, session_id: str, env: dict, work_dir: Path, mem: int
    ):
        self.runtime = runtime
        self.container = container
        self.session_id = session_id
        self.env = env
        self.work_dir = work_dir
        self.mem = mem
        self._stream = stream
        self.fd = stream.fileno()
        self.pid = int(container.attrs.get("State", {}).get("Pid") or 0) or None  # the host pid of its init
        self._status: dict | None = None

    # the terminal stream
    def read(self, size: int) -> bytes:
        try:
            return self._stream.recv(size)
        except BlockingIOError:
            raise
        except OSError:
            return b""

    def write(self, data) -> int:
        return self._stream.send(data)

    def close_stream(self) -> None:
        self._stream.close()

    def resize(self, rows: int, cols: int) -> None:
        try:
            self.container.resize(height=max(1, min(rows, 1000)), width=max(1, min(cols, 1000)))
        except Exception as exc:  # the container may have ended meanwhile
            log.debug("resize of %s failed: %s", self.session_id, exc)

    # its end
    def exit_fd(self) -> int | None:
        """The pidfd of the container's init where the agent shares the host's PID namespace."""
        if self.pid is None:
            return None
        try:
            return os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return None

    def poll(self) -> int | None:
        self.container.reload()
        state = self.container.attrs["State"]
        return None if state.get("Running") else int(state.get("ExitCode", 0))

    def wait(self) -> int:
        """Blocking: the container's exit code (128+N when killed by signal N)."""
        result = self.container.wait()
        self.container.reload()
        self._status = self.container.attrs["State"]
        return int(result.get("StatusCode", self._status.get("ExitCode", 0)))

    def end_reason(self, exit_code: int) -> str:
        """Why it ended, in words, where Docker knows better than the exit code (the OOM killer)."""
        state = self._status or {}
        if state.get("OOMKilled"):
            return f"killed: out of memory at its {format_binary_size(self.mem)} limit (exit code {exit_code})"
        return ""

    quick = False  # signals and waits are Docker API calls (see SessionHandle.quick)
    outlives_agent = True  # its container runs on without the agent; the next start adopts it

    def signal_all(self, *sigs: int) -> None:
        for sig in sigs:
            try:
                self.container.kill(signal=int(sig))  # to docker-init, which passes it on to the session's shell
            except Exception as exc:
                log.debug("signal %s to %s: %s", sig, self.session_id, exc)

    def signal_group(self, sig: int) -> int:
        """`sig` to the container (`docker kill --signal`: its init, docker-init, passes it on to
        the session's command): a preemption notice. Returns 1."""
        self.signal_all(sig)
        return 1

    def kill_all(self) -> int:
        """SIGKILL to the container's init: the kernel ends every process of its PID namespace.
        Returns 1 (whether anything was left is for `alive` to say)."""
        self.signal_all(signal.SIGKILL)
        return 1

    def alive(self) -> bool:
        try:
            self.container.reload()
        except Exception:  # gone
            return False
        return bool(self.container.attrs["State"].get("Running"))

    def remove(self) -> None:
        import docker

        try:
            self.container.remove(v=True, force=True)
        except docker.errors.APIError as exc:
            if exc.status_code in (404, 409):  # gone, or being removed (DockerRuntime.release_now at exit)
                log.debug("container of session %s: %s", self.session_id, exc.explanation or exc)
            else:
                log.warning("could not remove the container of session %s: %s", self.session_id, exc)
        except Exception as exc:
            log.warning("could not remove the container of session %s: %s", self.session_id, exc)

    def app_address(self) -> tuple[str, str]:
        """Blocking: where a web app in the container listens and where the agent's node reaches
        it (session apps, agent.session_apps): `("0.0.0.0", <the container's address>)`. Raises
        DockerRuntimeError when the container has no network address (network "none")."""
        self.container.reload()
        settings = self.container.attrs.get("NetworkSettings") or {}
        address = settings.get("IPAddress") or next(
            (net.get("IPAddress") for net in (settings.get("Networks") or {}).values() if net.get("IPAddress")), ""
        )
        if not address:
            raise DockerRuntimeError(
                "the session's container has no network address (agent.toml [container] "
                'network = "none"), so its apps cannot be reached'
            )
        return "0.0.0.0", address

    # commands beside it
    def exec_popen(self, argv: list[str], *, stdout, stderr) -> "DockerExec":
        return DockerExec(self, argv, stdout=stdout, stderr=stderr)

    def signal_exec(self, process, sig: int) -> None:
        process.send_signal(sig)


class DockerExec:
    """A command run in a session's container (`docker exec`), shaped like subprocess.Popen
    for the agent's exec paths: `pid` (its host pid), `poll()`, `wait(timeout)`, `stdout` /
    `stderr` (pipes when asked for subprocess.PIPE, else written to the given files),
    `send_signal(sig)` (to it and every process it started, found by parent links)."""

    def __init__(self, session: DockerSession, argv: list[str], *, stdout, stderr):
        api = session.runtime.client.api
        self.api = api
        try:
            self.exec_id = api.exec_create(
                session.container.id,
                argv,
                stdout=True,
                stderr=True,
                stdin=False,
                tty=False,
                environment=session.env,
                workdir=HOME,
                user=session.runtime.user,
            )["Id"]
            raw = api.exec_start(self.exec_id, socket=True)
        except Exception as exc:
            raise DockerRuntimeError(f"docker exec failed: {exc}") from exc
        self._sock = getattr(raw, "_sock", raw)
        self.stdout = self.stderr = None
        sinks = []
        for target in (stdout, stderr):
            if target == subprocess.PIPE:
                read_end, write_end = os.pipe()
                sinks.append(os.fdopen(write_end, "wb", buffering=0))
                if self.stdout is None and len(sinks) == 1:
                    self.stdout = os.fdopen(read_end, "rb", buffering=0)
                else:
                    self.stderr = os.fdopen(read_end, "rb", buffering=0)
            else:
                sinks.append(target)
        self._sinks = sinks
        self._own_sinks = [s for s, t in zip(sinks, (stdout, stderr)) if t == subprocess.PIPE]
        self.returncode: int | None = None
        self._pump = threading.Thread(target=self._demux, daemon=True, name=f"docker-exec-{self.exec_id[:8]}")
        self._pump.start()
        self.pid = self._host_pid()

    def _host_pid(self) -> int:
        for _ in range(50):
            pid = int(self.api.exec_inspect(self.exec_id).get("Pid") or 0)
            if pid:
                return pid
            threading.Event().wait(0.01)
        return 0

    def _demux(self) -> None:
        from docker.utils.socket import frames_iter

        try:
            for stream, data in frames_iter(self._sock, tty=False):
                sink = self._sinks[0 if stream == 1 else 1]
                sink.write(data)
        except Exception as exc:
            log.debug("docker exec %s stream ended: %s", self.exec_id[:8], exc)
        finally:
            for sink in self._own_sinks:
                sink.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            info = self.api.exec_inspect(self.exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                self._pump.join(timeout=1)
                self.returncode = int(info["ExitCode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._pump.join(timeout)
        if self._pump.is_alive():
            raise subprocess.TimeoutExpired(self.exec_id, timeout or 0.0)  # join(None) returns only once it ended
        for _ in range(200):  # the stream ends a moment before Docker records the exit code
            code = self.poll()
            if code is not None:
                return code
            threading.Event().wait(0.01)
        code = self.poll()
        return code if code is not None else 137

    def send_signal(self, sig: int) -> None:
        if self.pid:
            for pid in [*_descendants(self.pid), self.pid]:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


class DockerRuntime:
    """Sessions in containers (see the module docstring). `client`: a docker.DockerClient
    (default: docker.from_env(), i.e. DOCKER_HOST or the local socket); `default_image`: the
    image of a spec that names none; `uid`/`gid`: whom the session runs as inside; `network`:
    "outbound" (old name "bridge": agent.network's guarded network of this agent, named after
    `node` and `instance`, an agent installation's id, default one of `node` alone; private
    addresses dropped too where `block_private`) or "none"; `gpus`: ask the NVIDIA container toolkit for the granted devices (CUDA
    nodes; a mock node has nothing to ask for); `hami_core`: the node's libvgpu.so, preloaded in
    every session; `mps_pipe_directory`: the node's MPS pipe directory (None: no MPS); `pull`:
    pull an image the node lacks from its registry when a session needs it. Raises
    DockerRuntimeError when Docker cannot be reached."""

    name = DOCKER

    def __init__(
        self,
        *,
        node: str,
        default_image: str,
        uid: int = 1000,
        gid: int = 1000,
        network: str = OUTBOUND,
        instance: str | None = None,
        block_private: bool = True,
        gpus: bool = False,
        hami_core: Path | None = None,
        mps_pipe_directory: Path | None = None,
        pull: bool = True,
        limits: SessionLimits | None = None,
        client=None,
    ):
        import docker

        try:
            self.client = client or docker.from_env()
            self.client.ping()
        except Exception as exc:
            raise DockerRuntimeError(f"Docker Engine is not reachable: {exc}") from exc
        self.node = node
        self.default_image = default_image
        self.uid, self.gid = uid, gid
        self.user = f"{uid}:{gid}"
        try:
            self.network = network_mode(network)
        except ValueError as exc:
            raise DockerRuntimeError(f"network {exc}") from None
        self.instance = instance or instance_id(f"node:{node}")
        self.session_network = (
            SessionNetwork(self.client, node=node, instance=self.instance, block_private=block_private)
            if self.network == OUTBOUND
            else None
        )
        self.gpus = gpus
        self.hami_core = hami_core
        self.mps_pipe_directory = mps_pipe_directory
        self.pull = pull
        self.limits = limits if limits is not None else SessionLimits()  # [limits]: default memory, pids (agent.limits)
        self.cgroup_parent = ""  # all its containers' parent cgroup, capped at limits.node_pids (clean_up_at_start)
        self._cgroup_parent_name = ""

    def paths(self, work_dir: Path) -> SessionPaths:
        return SessionPaths(home=HOME, bin_dir=f"{TOOLS}/bin", allocation=f"{TOOLS}/allocation.json")

    def shell(self) -> str:
        return "/bin/bash"

    def base_path(self) -> str:
        return PATH.split(":", 1)[1]

    def install_tools(self, bin_dir: Path) -> None:
        """The virtual nvidia-smi in `bin_dir` for the container's own python3 (a copy of
        agent/nvidia_smi.py beside a small launcher)."""
        from agent import nvidia_smi

        nvidia_smi.install_portable(bin_dir)

    def container_config(
        self, *, spec: StartSpec, argv: list[str], env: dict[str, str], work_dir: Path, folders: Folders = NO_FOLDERS
    ) -> dict[str, Any]:
        """What the agent asks Docker for, as `containers.create` keyword arguments (pure): the
        container of start spec `spec` (its image, `mem` bytes, `cpu` cores, devices by hardware
        id) running `argv` with `env`, its home `work_dir` and its data `folders` (agent.mounts)
        bind-mounted."""
        import docker

        session_id = spec.session_id
        mem = spec.mem or self.limits.default_memory  # none asked: [limits] default-memory
        config: dict[str, Any] = dict(
            image=spec.image or self.default_image,
            command=argv,
            name=f"fgpu-{session_id}",
            hostname=f"s-{session_id[:8]}",
            tty=True,
            stdin_open=True,
            environment={**env, "PATH": PATH},
            working_dir=HOME,
            user=self.user,
            init=True,
            labels={
                LABEL_SESSION: session_id,
                LABEL_NODE: self.node,
                LABEL_WORK_DIR: str(work_dir),
                LABEL_INSTANCE: self.instance,
            },
            mounts=[
                docker.types.Mount(HOME, str(work_dir), type="bind"),
                docker.types.Mount(TOOLS, str(work_dir / ".fgpu"), type="bind", read_only=True),
            ],
            nano_cpus=(spec.cpu or 1) * 1_000_000_000,
            pids_limit=self.limits.session_pids,  # PIDS_LIMIT unless [limits] session-pids says otherwise
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            network_mode=self.session_network.names.network if self.session_network is not None else "none",
        )
        if self.cgroup_parent:  # all the agent's containers together: [limits] node-pids
            config["cgroup_parent"] = self.cgroup_parent
        if folders.data_dir is not None:  # the owner's persistent folder (agent.files) at ~/data
            config["mounts"].append(docker.types.Mount(f"{HOME}/data", str(folders.data_dir), type="bind"))
        for name, folder in folders.project_dirs.items():  # and each of their projects'
            config["mounts"].append(docker.types.Mount(f"{HOME}/projects/{name}", str(folder), type="bind"))
        for name, (folder, read_only) in folders.shared_dirs.items():  # the folders shared with them (issue 36.5)
            # a read-only share: a read-only volume
            config["mounts"].append(docker.types.Mount(f"{HOME}/shared/{name}", str(folder), type="bind", read_only=read_only))
        if mem:
            config.update(mem_limit=mem, memswap_limit=mem)  # swap off: the limit is the limit
        devices: list[str] = [d.hardware_id for d in spec.devices]
        if self.gpus and devices:  # the granted GPUs or MIG devices, by UUID (NVIDIA container toolkit)
            config["device_requests"] = [docker.types.DeviceRequest(driver="nvidia", device_ids=devices, capabilities=[["gpu"]])]
        if self.hami_core is not None:
            config["mounts"].append(docker.types.Mount(HAMI_CORE_PATH, str(self.hami_core), type="bind", read_only=True))
            config["environment"]["LD_PRELOAD"] = HAMI_CORE_PATH
        if self.mps_pipe_directory is not None:
            pipes = str(self.mps_pipe_directory)
            config["mounts"].append(docker.types.Mount(pipes, pipes, type="bind"))
            config["environment"]["CUDA_MPS_PIPE_DIRECTORY"] = pipes
            config["ipc_mode"] = "host"
        return config

    def spawn(
        self,
        *,
        spec: StartSpec,
        argv: list[str],
        env: dict[str, str],
        work_dir: Path,
        folders: Folders = NO_FOLDERS,
        progress: Callable[[str], None] | None = None,
    ) -> DockerSession:
        """Blocking: create the container of the session of start spec `spec` (`container_config`;
        pulling its image first where the node lacks it and `pull` is on; `progress(text)` hears
        how the pull goes), attach to its TTY, start it. Raises DockerRuntimeError with Docker's
        (or the registry's) words when the image cannot be had or Docker refuses."""
        import docker

        config = self.container_config(spec=spec, argv=argv, env=env, work_dir=work_dir, folders=folders)
        _give_home(work_dir, self.uid, self.gid)
        for folder in folders.all():  # the persistent folders mounted in it: the container's user's inside too
            _give_home(folder, self.uid, self.gid)
        try:
            try:
                container = self.client.containers.create(**config)
            except docker.errors.ImageNotFound:
                if not self.pull:
                    raise
                self.pull_image(config["image"], progress=progress)
                container = self.client.containers.create(**config)
            except docker.errors.NotFound as exc:
                if self.session_network is None or self.session_network.names.network not in str(exc):
                    raise
                self.session_network.ensure()  # someone removed the network: make it again
                container = self.client.containers.create(**config)
        except docker.errors.ImageNotFound:
            raise DockerRuntimeError(f"image {config['image']!r} is not on node {self.node}") from None
        except NetworkError as exc:
            raise DockerRuntimeError(str(exc)) from None
        except docker.errors.APIError as exc:
            raise DockerRuntimeError(f"Docker refused the session's container: {exc.explanation or exc}") from None
        try:
            stream = self._attach(container)
            container.start()
            container.reload()
        except Exception as exc:
            container.remove(force=True)
            raise DockerRuntimeError(f"Docker could not start the session's container: {exc}") from None
        return DockerSession(
            self,
            container,
            stream,
            session_id=spec.session_id,
            env=env,
            work_dir=work_dir,
            mem=int(config.get("mem_limit") or 0),
        )

    def pull_image(self, reference: str, *, progress=None) -> None:
        """Blocking: pull `reference` from its registry, calling `progress(text)` at most every
        PULL_PROGRESS_S with how far it got ("pulling image X: 41 % (88 of 214 MiB)"). Raises
        DockerRuntimeError with the registry's words when the pull fails."""
        import docker

        repository, tag = _split_reference(reference)
        layers: dict[str, tuple[int, int]] = {}  # layer id → (bytes done, bytes in all)
        last = 0.0
        try:
            for event in self.client.api.pull(repository, tag=tag, stream=True, decode=True):
                if event.get("error"):
                    raise DockerRuntimeError(f"pulling image {reference!r} failed: {event['error']}")
                detail = event.get("progressDetail") or {}
                if event.get("id") and detail.get("total"):
                    layers[event["id"]] = (int(detail.get("current") or 0), int(detail["total"]))
                elif (
                    event.get("id")
                    and event.get("status") in ("Download complete", "Pull complete", "Already exists")
                    and event["id"] in layers
                ):
                    layers[event["id"]] = (layers[event["id"]][1], layers[event["id"]][1])
                now = time.monotonic()
                if progress is not None and layers and now - last >= PULL_PROGRESS_S:
                    done, total = sum(d for d, _ in layers.values()), sum(t for _, t in layers.values())
                    progress(f"pulling image {reference}: {100 * done // max(total, 1)} % ({done >> 20} of {total >> 20} MiB)")
                    last = now
        except docker.errors.APIError as exc:
            raise DockerRuntimeError(f"pulling image {reference!r} failed: {exc.explanation or exc}") from None
        except docker.errors.DockerException as exc:
            raise DockerRuntimeError(f"pulling image {reference!r} failed: {exc}") from None
        if progress is not None:
            progress(f"pulled image {reference}; starting the session")

    def _attach(self, container) -> socket.socket:
        raw = container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock = getattr(raw, "_sock", raw)
        sock.setblocking(False)
        return sock

    def clean_up_at_start(self, scratch_root: Path) -> tuple[list[DockerSession], int]:
        """Blocking, when the agent starts: adopt this node's running session containers (their
        scrollback seeded from the container's last output), remove the ended ones; make the
        sessions' network and its rules (network "outbound", SessionNetwork.ensure). Returns
        (adopted handles, how many containers were removed). Raises DockerRuntimeError when Docker
        refuses the network."""
        if self.session_network is not None:
            try:
                self.session_network.ensure()
            except NetworkError as exc:
                raise DockerRuntimeError(str(exc)) from None
        self._open_cgroup_parent(scratch_root)
        adopted, removed = [], 0
        for container in self.client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={self.node}"}):
            labels = container.labels
            if not self._made_here(labels, scratch_root):
                continue  # another installation's (another console on this host): never ours to adopt or remove
            if container.status == "running":
                env = dict(item.split("=", 1) for item in container.attrs["Config"].get("Env") or [] if "=" in item)
                handle = DockerSession(
                    self,
                    container,
                    self._attach(container),
                    session_id=labels[LABEL_SESSION],
                    env=env,
                    work_dir=Path(labels.get(LABEL_WORK_DIR, scratch_root)),
                    mem=int(container.attrs["HostConfig"].get("Memory") or 0),
                )
                adopted.append(handle)
            else:
                container.remove(v=True, force=True)
                removed += 1
        return adopted, removed

    def _open_cgroup_parent(self, scratch_root: Path) -> None:
        """Blocking: the parent cgroup of this agent's containers, `/<agent.runtimes.parent_cgroup_name>`
        (its node, instance and FGPU_CGROUP_TAG, as the process runtime's), its pids.max the node's
        cap on all of them (agent.limits.docker_parent_open); where it cannot be (Docker's systemd
        driver, no pids controller), containers go where Docker puts them and the agent says why."""
        self._cgroup_parent_name = parent_cgroup_name(self.node, scratch_root, tag=cgroup_tag())
        try:
            driver = str(self.client.info().get("CgroupDriver") or "")
        except Exception:  # Docker went away meanwhile: no parent (docker_parent_open says why)
            driver = ""
        self.cgroup_parent, why = docker_parent_open(self._cgroup_parent_name, node_pids=self.limits.node_pids,
                                                     cgroup_driver=driver)  # fmt: skip
        if not self.cgroup_parent:
            log.warning("sessions' containers together are not held to %d pids: %s", self.limits.node_pids, why)

    def _made_here(self, labels: dict, scratch_root: Path) -> bool:
        """Whether a container with `labels` (of this node) is this installation's: its instance
        label is ours, or, on a container from before that label, its work dir lies under
        `scratch_root`."""
        if LABEL_INSTANCE in labels:
            return labels[LABEL_INSTANCE] == self.instance
        work_dir = labels.get(LABEL_WORK_DIR, "")
        return bool(work_dir) and Path(scratch_root) in Path(work_dir).parents

    @property
    def network_warning(self) -> str:
        """Why the sessions' network is not guarded, for the operator ("" when it is, or "none")."""
        return self.session_network.warning if self.session_network is not None else ""

    def close(self) -> None:
        """Blocking, when the agent shuts down after its sessions ended: remove the sessions'
        network and its rules unless a container is still on it (Agent.shutdown), and the
        containers' parent cgroup where none is left in it."""
        if self.session_network is not None:
            self.session_network.remove()
        if self._cgroup_parent_name:
            docker_parent_remove(self._cgroup_parent_name)

    def release_now(self) -> None:
        """Blocking, when a host process exits after killing its sessions (Agent.kill_all_now,
        standalone): remove this agent's containers on its network, then the network and its rules.
        With network "none" the killed containers are left for the next start's clean-up. The
        containers' parent cgroup goes where none is left in it."""
        if self.session_network is None:
            if self._cgroup_parent_name:
                docker_parent_remove(self._cgroup_parent_name)
            return
        network = self.session_network.names.network
        try:
            ours = [f"{LABEL_NODE}={self.node}", f"{LABEL_INSTANCE}={self.instance}"]
            for container in self.client.containers.list(all=True, filters={"label": ours, "network": network}):
                container.remove(v=True, force=True)
        except Exception as exc:  # Docker went away meanwhile: the next start cleans up
            log.warning("agent %s: could not remove its containers on %s: %s", self.node, network, exc)
            return
        self.session_network.remove()
        if self._cgroup_parent_name:
            docker_parent_remove(self._cgroup_parent_name)

    def images(self) -> dict[str, str]:
        """Blocking: the local images, `{reference: image id}`, every tag ("fgpu-session:test") and
        repository digest ("nvcr.io/nvidia/pytorch@sha256:…") of each, as Docker lists them.
        Raises what the Docker SDK raises when the engine does not answer."""
        held: dict[str, str] = {}
        service_ports: dict[str, str] = {}
        for image in self.client.images.list():
            for reference in [*(image.tags or []), *(image.attrs.get("RepoDigests") or [])]:
                if not reference.startswith("<none>"):  # an untagged image's placeholder
                    held[reference] = str(image.id)  # a listed image has its id
            label = (image.labels or {}).get(protocol.SERVICE_PORTS_LABEL)
            if isinstance(label, str) and label:
                service_ports[str(image.id)] = label[:1024]
        self._service_ports = service_ports
        return held

    def image_service_ports(self) -> dict[str, str]:
        """`{image id: its ai.backend.service-ports label}` of the local images that carry one, as
        the last `images()` listed them (the label read from the image's inspect, Config.Labels)."""
        return dict(getattr(self, "_service_ports", {}))

    def holds_image(self, reference: str) -> bool:
        import docker

        try:
            self.client.images.get(reference)
            return True
        except docker.errors.ImageNotFound:
            return False


def _give_home(work_dir: Path, uid: int, gid: int) -> None:
    """The session's user owns its home (its `.fgpu` stays the agent's, mounted read-only)."""
    try:
        os.chown(work_dir, uid, gid)
    except PermissionError:  # an agent that is not root: the directory must be writable already
        os.chmod(work_dir, 0o777)


def _descendants(pid: int, *, proc: str = "/proc") -> list[int]:
    """Every process below `pid` by parent links (one scan of `proc`)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc}/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
