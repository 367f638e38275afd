"""What a session may use on its node, and where the kernel holds it to that: memory, CPU and
processes through cgroups (issue 31, items 2 and 6), for the process runtime.

A session's limits (`SessionLimits.for_session`): its start spec's `mem` (bytes; where none is
asked, agent.toml's `[limits] default-memory`, default 4 GiB, at most the node's memory), its
`cpu` (cores, 1 where none is asked, as a CFS quota: `cpu` × 100 ms of CPU time every 100 ms) and `[limits]
session-pids` processes (default 4096, the docker runtime's PIDS_LIMIT). All sessions of one
agent together: `[limits] node-pids` processes (default 16384), the pids.max of the agent's
parent cgroup, so a fork bomb in one session, or in several, cannot take the node's last pids.

Where each controller lives (`Hierarchies.open`): the cgroup v2 hierarchy where it offers the
controller (`cgroup.controllers`), enabled for the sessions in the parent's
`cgroup.subtree_control` (and in the root's, where the root is the hierarchy's top and has it
not yet); else a cgroup v1 hierarchy that holds it (/sys/fs/cgroup/memory, …/pids, …/cpu on a
hybrid machine), where the agent's parent is `<mount>/<parent name>` and each session's
`<mount>/<parent name>/session-<id>`; the session's leader joins each of them before it execs
(`SessionCgroup.procs_paths`). A controller found nowhere, or whose files cannot be written,
is not enforced, and the agent says so once when it starts (`Hierarchies.missing`).

Files written (v2 / v1):

- memory: `memory.max` and `memory.swap.max` = 0 / `memory.limit_in_bytes` and, where swap
  accounting is on, `memory.memsw.limit_in_bytes` (the same: no swap past the limit). Past it,
  the kernel's OOM killer ends a process of the session (`oom_kills` counts them).
- cpu: `cpu.max` = "<quota µs> 100000" / `cpu.cfs_period_us` = 100000, `cpu.cfs_quota_us`.
- pids: `pids.max` (both).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

log = logging.getLogger(__name__)

GiB = 1 << 30
CONTROLLERS = ("memory", "cpu", "pids")
DEFAULT_MEMORY = 4 * GiB  # a session's memory where its start spec asks none (and the node has as much)
SESSION_PIDS = 4096  # a session's processes and threads (the docker runtime's PIDS_LIMIT)
NODE_PIDS = 16384  # all sessions of one agent together
SESSION_STORAGE = 10 * GiB  # a session's home (scratch) and container layer
USER_DATA_STORAGE = 10 * GiB  # a user's ~/data folder
PROJECT_DATA_STORAGE = 10 * GiB  # a project's data folder (~/projects/<name>)
STORAGE_INTERVAL_S = 60  # seconds between two measures of a session's storage
CPU_PERIOD_US = 100_000  # the CFS period: 100 ms
MIN_CPU_QUOTA_US = 1000  # the kernel's least quota (1 ms)


@dataclass(frozen=True)
class SessionLimits:
    """agent.toml's `[limits]`: `default_memory` (bytes, for a session whose start spec asks no
    `mem`), `session_pids` and `node_pids` (processes and threads: one session's, all of the
    agent's sessions' together), `session_storage` (bytes in a session's home and container
    layer), `user_data_storage` (bytes in a user's ~/data), `project_data_storage` (bytes in a
    project's data folder, ~/projects/<name>), `storage_interval_s` (seconds between measures
    where no file system quota holds them)."""

    default_memory: int = DEFAULT_MEMORY
    session_pids: int = SESSION_PIDS
    node_pids: int = NODE_PIDS
    session_storage: int = SESSION_STORAGE
    user_data_storage: int = USER_DATA_STORAGE
    project_data_storage: int = PROJECT_DATA_STORAGE
    storage_interval_s: int = STORAGE_INTERVAL_S

    def memory_for(self, mem: int) -> int:
        """Bytes a session that asked `mem` bytes (a start spec's `mem`; 0: none) may hold: `mem`,
        else `default_memory`."""
        return mem or self.default_memory

    def for_session(self, *, mem: int = 0, cpu: int | str | Decimal = 1) -> dict[str, int]:
        """What the cgroup of a session that asks `mem` bytes and `cpu` cores (its start spec's
        `mem` and `cpu`; 0: none asked) gets: {"memory": bytes (`memory_for(mem)`), "cpu": quota µs
        per CPU_PERIOD_US (`cpu` cores; 1 core where none is asked, as the docker runtime),
        "pids": processes}."""
        return {"memory": self.memory_for(mem), "cpu": cpu_quota_us(cpu or 1), "pids": self.session_pids}


def cpu_quota_us(cores) -> int:
    """The CFS quota (µs per CPU_PERIOD_US) of `cores` (a number or a decimal string, e.g. 2 or
    "0.5"); 0 for none, zero or a value that is not a number."""
    try:
        value = Decimal(str(cores)) if cores not in (None, "") else Decimal(0)
    except InvalidOperation:
        return 0
    if not value.is_finite() or value <= 0:
        return 0
    return max(MIN_CPU_QUOTA_US, int(value * CPU_PERIOD_US))


def cgroup_v1_mounts(*, mountinfo: str = "/proc/self/mountinfo") -> dict[str, Path]:
    """{controller: mount point} of the cgroup v1 hierarchies (`cgroup` file systems) this
    process sees, for the controllers in CONTROLLERS; {} where /proc cannot tell."""
    found: dict[str, Path] = {}
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            return {}
        after = fields[1].split()
        if after[:1] != ["cgroup"] or len(after) < 3:
            continue
        options = after[2].split(",")
        point = Path(fields[0].split()[4].replace("\\040", " "))
        for controller in CONTROLLERS:
            if controller in options:
                found.setdefault(controller, point)
    return found


@dataclass
class Hierarchies:
    """Where one agent's sessions are limited: `v2` (the cgroup v2 parent, `controllers` enabled
    for its children), `v1` ({controller: the parent's directory in the v1 hierarchy holding
    it}, several controllers may share one) and `missing` ({controller: why it is not
    enforced})."""

    v2: Path
    controllers: frozenset[str] = frozenset()
    v1: dict[str, Path] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open(cls, v2_parent: Path, *, node_pids: int, mountinfo: str = "/proc/self/mountinfo") -> Hierarchies:
        """Blocking: enable what cgroup v2 offers under `v2_parent` (which exists, with no process
        in it), make the parent's directory in the v1 hierarchies of the rest, and cap all
        sessions' processes at `node_pids` (the parent's pids.max). Never raises: what fails
        lands in `missing` with the reason."""
        hierarchies = cls(v2_parent)
        offered = set(_read_words(v2_parent.parent / "cgroup.controllers"))
        enabled = set()
        for controller in CONTROLLERS:
            if controller not in offered:
                continue
            why = _enable(v2_parent, controller)
            if why:
                hierarchies.missing[controller] = why
            else:
                enabled.add(controller)
        hierarchies.controllers = frozenset(enabled)
        mounts = cgroup_v1_mounts(mountinfo=mountinfo)
        for controller in CONTROLLERS:
            if controller in enabled or controller in hierarchies.missing:
                continue
            mount = mounts.get(controller)
            if mount is None:
                hierarchies.missing[controller] = "neither cgroup v2 nor a cgroup v1 hierarchy offers it"
                continue
            directory = mount / v2_parent.name
            try:
                directory.mkdir(exist_ok=True)
            except OSError as exc:
                hierarchies.missing[controller] = f"cannot create {directory}: {exc.strerror or exc}"
                continue
            hierarchies.v1[controller] = directory
        pids = hierarchies.directory("pids")
        if pids is not None:
            try:
                write_file(pids / "pids.max", str(node_pids))
            except OSError as exc:
                hierarchies.missing["pids"] = f"cannot write {pids / 'pids.max'}: {exc.strerror or exc}"
        return hierarchies

    def directory(self, controller: str) -> Path | None:
        """The parent's directory that holds `controller`, or None (not enforced)."""
        if controller in self.controllers:
            return self.v2
        return self.v1.get(controller)

    def v1_parents(self) -> list[Path]:
        """The parent's directories in v1 hierarchies, each once (cpu and cpuacct may share one)."""
        return sorted(set(self.v1.values()))

    def drop_v1(self, why: str) -> None:
        """Stop using the v1 hierarchies (a leader could not join them): each controller they held
        is missing for `why`; their directories are removed where empty."""
        for controller in list(self.v1):
            self.missing[controller] = why
        for directory in self.v1_parents():
            remove_dir(directory)
        self.v1 = {}

    def session_dirs(self, name: str) -> list[Path]:
        """Session `name`'s directories in the v1 hierarchies (not created here)."""
        return [parent / name for parent in self.v1_parents()]

    def apply(self, name: str, limits: dict[str, int]) -> None:
        """Blocking: write `limits` (SessionLimits.for_session) into session `name`'s cgroups (its v2
        one under `v2`, made by the caller, and those of `session_dirs`). Raises OSError."""
        memory, cpu, pids = self.directory("memory"), self.directory("cpu"), self.directory("pids")
        if memory is not None:
            if "memory" in self.controllers:
                write_file(memory / name / "memory.max", str(limits["memory"]))
                _write_if_present(memory / name / "memory.swap.max", "0")
            else:
                write_file(memory / name / "memory.limit_in_bytes", str(limits["memory"]))
                _write_if_present(memory / name / "memory.memsw.limit_in_bytes", str(limits["memory"]))
        if cpu is not None and limits["cpu"]:
            if "cpu" in self.controllers:
                write_file(cpu / name / "cpu.max", f"{limits['cpu']} {CPU_PERIOD_US}")
            else:
                write_file(cpu / name / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                write_file(cpu / name / "cpu.cfs_quota_us", str(limits["cpu"]))
        if pids is not None:
            write_file(pids / name / "pids.max", str(limits["pids"]))

    def memory_limit(self, name: str) -> int:
        """Session `name`'s memory limit in bytes (0: none, or unknown)."""
        memory = self.directory("memory")
        if memory is None:
            return 0
        source = "memory.max" if "memory" in self.controllers else "memory.limit_in_bytes"
        try:
            value = (memory / name / source).read_text().strip()
        except OSError:
            return 0
        return int(value) if value.isdigit() and int(value) < 1 << 62 else 0

    def oom_kills(self, name: str) -> int:
        """How many of session `name`'s processes the OOM killer ended (v2 memory.events'
        oom_kill, v1 memory.oom_control's oom_kill); 0 where unknown."""
        memory = self.directory("memory")
        if memory is None:
            return 0
        source = "memory.events" if "memory" in self.controllers else "memory.oom_control"
        try:
            text = (memory / name / source).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0


def _enable(parent: Path, controller: str) -> str:
    """Enable cgroup v2 `controller` for `parent`'s children (and for `parent` itself in its
    parent's subtree_control where that lacks it). Returns "" or why not."""
    for directory in (parent.parent, parent):
        control = directory / "cgroup.subtree_control"
        if controller in _read_words(control):
            continue
        try:
            write_file(control, f"+{controller}")
        except OSError as exc:
            return f"cannot enable it in {control}: {exc.strerror or exc}"
    return ""


def _read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def write_file(path: Path, text: str) -> None:
    """Blocking: `text` into cgroup file `path` in one write. Raises OSError."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _write_if_present(path: Path, text: str) -> None:
    """As write_file, where the file exists (swap accounting may be off)."""
    if path.exists():
        write_file(path, text)


def remove_dir(path: Path) -> bool:
    """rmdir `path` (a cgroup with no process left). Returns whether it is gone."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


# --- the docker runtime's containers: one parent cgroup for all of an agent's sessions -------------


def docker_parent_open(
    name: str, *, node_pids: int, cgroup_driver: str, mountinfo: str = "/proc/self/mountinfo"
) -> tuple[str, str]:
    """Blocking: the `cgroup_parent` of an agent's session containers, `/<name>`, with its pids.max
    written (`node_pids`: all its containers together), made before Docker puts a container in
    it (Docker's cgroupfs driver creates the rest of the path in every hierarchy). Returns
    (cgroup_parent, "") or ("", why the node-wide cap is not enforced for containers): Docker's
    systemd driver (its parents are slices the agent does not manage), no pids controller, or a
    file that cannot be written."""
    if cgroup_driver != "cgroupfs":
        return "", f"Docker's cgroup driver is {cgroup_driver or 'unknown'}, not cgroupfs"
    found = _docker_pids_directory(name, mountinfo=mountinfo)
    if found is None:
        return "", "no pids controller is offered (cgroup v2 without it, and no cgroup v1 pids hierarchy)"
    directory, v2 = found
    try:
        directory.mkdir(exist_ok=True)
        why = _enable(directory, "pids") if v2 else ""  # v2: in the root's subtree_control and the parent's
        if why:
            return "", why
        write_file(directory / "pids.max", str(node_pids))
    except OSError as exc:
        return "", f"cannot cap {directory}: {exc.strerror or exc}"
    return f"/{name}", ""


def docker_parent_remove(name: str, *, mountinfo: str = "/proc/self/mountinfo") -> None:
    """Blocking: remove the parent `/<name>` of an agent's containers from every cgroup hierarchy
    Docker made it in, where no container is left in it (a container's own cgroup is removed
    with the container)."""
    for top in _all_hierarchies(mountinfo=mountinfo):
        remove_dir(top / name)


def _docker_pids_directory(name: str, *, mountinfo: str) -> tuple[Path, bool] | None:
    """(Where the containers' parent `name` holds the pids controller, whether that is cgroup v2),
    or None."""
    v1 = cgroup_v1_mounts(mountinfo=mountinfo).get("pids")
    if v1 is not None:
        return v1 / name, False
    for top in _all_hierarchies(mountinfo=mountinfo):
        if "pids" in _read_words(top / "cgroup.controllers"):
            return top / name, True
    return None


def _all_hierarchies(*, mountinfo: str) -> list[Path]:
    """The mount points of every cgroup hierarchy (v1 and v2) this process sees."""
    return cgroup_mounts(("cgroup", "cgroup2"), mountinfo=mountinfo)


def cgroup_mounts(types: tuple[str, ...], *, mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    """The mount points of the file systems of `types` ("cgroup": v1 hierarchies, "cgroup2"), as
    /proc/self/mountinfo (`mountinfo`) lists them; [] where it cannot be read."""
    found = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[1].split()[:1] and fields[1].split()[0] in types:
            found.append(Path(fields[0].split()[4].replace("\\040", " ")))
    return found
