"""A session's life on its node: its spawn as explicit stages, its stop, and what its end leaves.

Spawn (blocking, on the agent's work pool; `spawn`), stage by stage, each a function of the start
spec and what the stages before it made, as Backend.AI's agent provisions a kernel in stages
(`kernel_lifecycle`: scratch, resources, environ, mounts, container create/start):

1. `stage_mig`: the MIG instance the spec's `mig` block asks for, created or reused (issue 4);
   its device entry replaces the GPU's.
2. `stage_work_dir`: the session's working directory `<scratch_root>/<session id>` and its
   `.fgpu/bin`.
3. `stage_allocation`: the allocation document (`.fgpu/allocation.json`, agent.environment) the
   virtual nvidia-smi reads.
4. `stage_tools`: the runtime's tools (the virtual nvidia-smi) in `.fgpu/bin`.
5. `stage_folders`: the owner's persistent folder and its projects' (agent.files), linked at
   ~/data and ~/projects/<name> (the process runtime) or named for the docker runtime to mount.
6. `stage_environment`: the environment contract (DESIGN.md; agent.environment) with the paths
   as the session sees them, and its prompt.
7. `stage_command`: the argv: the command through the shell, or an interactive shell.
8. `stage_process`: the process (or container) through the runtime.

A stage that raises ends the spawn (the agent reports ERROR with the reason; a process that
exists is killed: `Agent._abandon`). Stop (`signal_until_exit`): SIGHUP and SIGTERM to every
process of the session, SIGHUP again within KILL_GRACE_S, then SIGKILL. End: `reap_and_kill`,
`wait_gone` (every process of the session gone before TERMINATED frees its slice), and the sweep
of ended sessions' working directories (`sweep_scratch`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import files as session_files
from agent import mig as mig_runtime
from protocol.environment import allocation_document, session_environment
from agent.runtimes import ProcessRuntime
from protocol.messages import StartSpec

KILL_GRACE_S = 3.0
# Within the grace, SIGHUP again after this many seconds, then after twice as long each time: an
# interactive bash that takes the first while it starts up (its handler installed, its readline
# loop not yet entered) notes it and then waits at its prompt (seen on about 1 stop in 100 made
# within 30 ms of the launch: benchmarks/launch.py); the next SIGHUP ends it.
RESIGNAL_S = 0.05
KILL_WAIT_S = 2.0  # after SIGKILL, how long TERMINATED waits for the session's processes to be gone


@dataclass(frozen=True)
class Node:
    """What a spawn needs of its node: `scratch_root` (working directories), `data_root` (users'
    persistent folders; None: none), the `runtime` (agent.runtimes), the node's `mig` manager,
    `mock` (a mock node: the allocation document says so), `mps` (the node runs NVIDIA MPS) and
    its inventory's `attributes`."""

    name: str
    scratch_root: Path
    data_root: Path | None
    runtime: Any
    mig: Any
    mock: bool
    mps: bool
    attributes: dict


@dataclass(frozen=True)
class WorkDir:
    path: Path  # <scratch_root>/<session id>
    bin_dir: Path  # its .fgpu/bin, first on the session's PATH


@dataclass(frozen=True)
class Folders:
    data_dir: Path | None  # the owner's persistent folder (~/data); None: the node keeps none
    project_dirs: dict[str, Path]  # its projects' folders (~/projects/<name>)


@dataclass(frozen=True)
class Spawned:
    """What a spawn made: the runtime's `handle` and what the agent keeps of the session."""

    handle: Any
    work_dir: Path
    env: dict[str, str]
    data_dir: Path | None
    project_dirs: dict[str, Path]


def stage_mig(node: Node, start: StartSpec) -> StartSpec:
    """The start spec with its MIG block carried out (agent.mig.prepare_spec, read back through
    the decoder); unchanged without one. Raises MigError."""
    if start.mig is None:
        return start
    return StartSpec.decode(mig_runtime.prepare_spec(node.mig, start.encode()))


def stage_work_dir(node: Node, start: StartSpec) -> WorkDir:
    path = node.scratch_root / start.session_id
    bin_dir = path / ".fgpu" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    return WorkDir(path, bin_dir)


def stage_allocation(node: Node, start: StartSpec, work: WorkDir) -> Path:
    """Write the allocation document; returns its path (on the node)."""
    document = allocation_document(start.encode(), node=node.name, mock=node.mock, attributes=node.attributes)
    path = work.path / ".fgpu" / "allocation.json"
    path.write_text(json.dumps(document, indent=2))
    return path


def stage_tools(node: Node, work: WorkDir) -> None:
    node.runtime.install_tools(work.bin_dir)


def stage_folders(node: Node, start: StartSpec, work: WorkDir) -> Folders:
    folder = session_files.data_folder(node.data_root, start.owner_id)  # the owner's persistent folder
    projects = session_files.project_folders(node.data_root, [p.encode() for p in start.projects])  # and its projects'
    session_files.link_data(work_dir=work.path, folder=folder, link=isinstance(node.runtime, ProcessRuntime), projects=projects)
    return Folders(folder, projects)


def runtime_spec(start: StartSpec, folders: Folders) -> dict:
    """The start spec as the environment and the runtimes read it: its dict, with the node's
    folders (`data_dir`, `project_dirs`: the docker runtime mounts them at ~/data, ~/projects/<name>)."""
    return {
        **start.encode(),
        "data_dir": str(folders.data_dir) if folders.data_dir is not None else "",
        "project_dirs": {name: str(p) for name, p in folders.project_dirs.items()},
    }


def stage_environment(node: Node, start: StartSpec, spec: dict, work: WorkDir) -> dict[str, str]:
    """The session's environment (agent.environment.session_environment) with the paths where the
    session sees its files (`runtime.paths`), and its prompt."""
    inside = node.runtime.paths(work.path)
    env = session_environment(
        spec,
        allocation_path=inside.allocation,
        bin_dir=inside.bin_dir,
        work_dir=inside.home,
        base_path=node.runtime.base_path(),
        mps=node.mps,
    )
    env["PS1"] = f"{start.owner}@{start.name}:\\w\\$ "
    return env


def stage_command(node: Node, start: StartSpec) -> list[str]:
    """The command through the shell (the session image's, where it names one), or an
    interactive shell (bash without its profile and rc files)."""
    shell = start.shell or node.runtime.shell()
    if start.command:
        return [shell, "-c", start.command]
    return [shell, "--noprofile", "--norc", "-i"] if shell.endswith("bash") else [shell, "-i"]


def stage_process(
    node: Node, spec: dict, argv: list[str], env: dict[str, str], work: WorkDir, progress: Callable[[str], None]
) -> Any:
    """The session's process (its own process session, or its own container): the runtime's handle.
    `progress(text)`: the runtime's word on a slow start (an image pull)."""
    return node.runtime.spawn(spec=spec, argv=argv, env=env, work_dir=work.path, progress=progress)


def spawn(node: Node, start: StartSpec, *, progress: Callable[[str], None]) -> Spawned:
    """Blocking: the stages in order (see the module docstring). Raises what a stage raises."""
    start = stage_mig(node, start)
    work = stage_work_dir(node, start)
    stage_allocation(node, start, work)
    stage_tools(node, work)
    folders = stage_folders(node, start, work)
    spec = runtime_spec(start, folders)
    env = stage_environment(node, start, spec, work)
    argv = stage_command(node, start)
    handle = stage_process(node, spec, argv, env, work, progress)
    return Spawned(handle, work.path, env, folders.data_dir, folders.project_dirs)


# --- stop and end ------------------------------------------------------------------------

OnProcess = Callable[..., Awaitable[Any]]  # on_process(fn, *args): a call on the session's process


async def signal_until_exit(
    process: Any, exited: asyncio.Event, on_process: OnProcess, *, grace_s: float = KILL_GRACE_S, resignal_s: float = RESIGNAL_S
) -> None:
    """Stop a session's processes: SIGHUP (ends an interactive shell, which ignores SIGTERM) and
    SIGTERM (what ignores SIGHUP: nohup) to every process of the session, every group; SIGHUP again
    after `resignal_s`, then after twice as long each time; SIGKILL to all once `grace_s` seconds
    passed without the leader's exit (`exited`). Returns when the leader exited or all got SIGKILL."""
    await on_process(process.signal_all, signal.SIGHUP, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + grace_s, resignal_s
    while not exited.is_set():
        remaining = deadline - loop.time()
        if remaining <= 0:  # the leader did not end in time (once it has, the agent's exit handling kills the rest)
            await on_process(process.kill_all)
            return
        try:
            await asyncio.wait_for(exited.wait(), timeout=min(pause, remaining))
        except TimeoutError:
            if loop.time() < deadline:
                await on_process(process.signal_all, signal.SIGHUP)
            pause *= 2


def reap_and_kill(process: Any) -> tuple[int, int]:
    """Blocking, in one hop to a worker thread: the exited leader's status (`process.wait`) and
    how many processes of its session were left and got SIGKILL (`process.kill_all`)."""
    return process.wait(), process.kill_all()


async def wait_gone(process: Any, *, deadline: float, alive: Callable[[], Awaitable[bool]]) -> None:
    """Until no process of the session is left, or the loop's clock passes `deadline`: woken by
    its cgroup's events where it has a cgroup (`process.watch()`: the kernel says when its last
    process exited; it notifies a cgroup.events file at most every 10 ms, so a session ending
    within 10 ms of its last change may wait up to that), else `alive()` (the runtime's scan, off
    the loop) polled every 5 ms at first, then less often."""
    loop = asyncio.get_running_loop()
    watch = getattr(process, "watch", lambda: None)()  # a docker session has none
    if watch is None:
        pause = 0.005
        while loop.time() < deadline and await alive():
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        return
    changed = asyncio.Event()

    def on_change() -> None:
        watch.clear()
        changed.set()

    loop.add_reader(watch.fd, on_change)
    try:
        while watch.populated():  # read after arming: an exit in between still wakes us
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=remaining)
            except TimeoutError:
                return
            changed.clear()
    finally:
        loop.remove_reader(watch.fd)
        watch.close()


def exit_code_of(status: int) -> int:
    """A wait status as shells report it: killed by signal N → 128+N."""
    return status if status >= 0 else 128 - status


def outlives_agent(process: Any) -> bool:
    """Whether a session's process (a runtime's handle) runs on when its agent exits, for the next
    start to adopt: a held process-runtime session (agent.holder) or a docker container."""
    return bool(getattr(process, "outlives_agent", False))


def sweep_scratch(scratch_root: Path, *, keep: set[str], older_than_s: float) -> int:
    """Remove the working directories under `scratch_root` of sessions not in `keep` that were
    last changed more than `older_than_s` seconds ago (the agent touches one when its session
    ends); never the agent's own entries, whose names start with a dot (the process runtime's
    `.holders`: its held sessions' sockets and records, which the next start adopts them by).
    Returns how many were removed."""
    horizon, removed = time.time() - older_than_s, 0
    try:
        entries = list(os.scandir(scratch_root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            stale = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < horizon
        except OSError:
            continue
        if stale and entry.name not in keep and not entry.name.startswith("."):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
