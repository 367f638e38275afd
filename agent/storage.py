"""What a session stores on its node, and the limits on it (issue 31, item 6): each session's home
(its scratch directory, the working directory the agent made) and, in the docker runtime, its
container's writable layer, together at most `[limits] session-storage` bytes (default 10 GiB);
each user's persistent `~/data` folder at most `[limits] user-data-storage` bytes (default
10 GiB), whichever of the user's sessions on the node wrote it; each project's data folder
(`~/projects/<name>`) at most `[limits] project-data-storage` bytes (default 10 GiB), whichever of
its members' sessions wrote it: every session that mounts a folder past its limit is stopped (a
folder shared read-write, `~/shared/<name>`, counts for the sessions of those it is shared with too).

The file systems under the scratch and data roots of this project's nodes have no project quotas
(ext4 without the `project` feature, overlay2 on ext4), so the agent measures instead: every
`[limits] storage-interval` seconds (default 60) it walks each running session's home and each
user's data folder (`measure`: os.scandir, not following symbolic links nor crossing into another
file system, each inode once, allocated blocks, at most MEASURE_BUDGET entries a tree so a
measure stays cheap), asks Docker for a container's SizeRw (`docker inspect --size`), and stops a
session past a limit with the reason, e.g. "used 10.3 GiB of its 10 GiB storage limit (home and
container layer)". Sessions at WARN_FRACTION of a limit are told once in their terminal. The
figures are in each session's usage samples (`storage` and `storage_limit`, bytes; `folders`: each
data folder's use and limit: agent.usage), which the manager stores and shows (usage.models).

A tree with more than MEASURE_BUDGET entries is measured in part (its first entries): a lower
bound, logged once; it stops a session only where even that passes the limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path

from protocol.units import format_binary_size
from agent.limits import SessionLimits

log = logging.getLogger(__name__)

MEASURE_BUDGET = 200_000  # entries one measure of one tree reads at most
WARN_FRACTION = 0.9  # a session is told once when it reaches this share of a limit


def measure(root: Path, *, budget: int = MEASURE_BUDGET) -> tuple[int, bool]:
    """Blocking: (bytes allocated to the files under `root`, whether every entry was read). Bytes
    are st_blocks × 512 (a sparse file counts what it holds, a preallocated one all it took);
    each inode once (hard links); symbolic links are not followed and another file system
    mounted inside is not entered; an entry that vanishes meanwhile or cannot be read is
    skipped. Stops after `budget` entries: (bytes so far, False). (0, True) where `root` is
    missing."""
    try:
        top = os.lstat(root)
    except OSError:
        return 0, True
    if not stat.S_ISDIR(top.st_mode):
        return top.st_blocks * 512, True
    seen: set[tuple[int, int]] = set()
    used, read = top.st_blocks * 512, 0
    stack = [os.fspath(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                read += 1
                if read > budget:
                    return used, False
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev:
                    continue  # a mount inside: not this tree's storage
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                used += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return used, True


def container_layer_size(handle) -> int:
    """Blocking: bytes in the writable layer of the container of a docker runtime's session
    (`handle.container`; Docker's SizeRw, which it computes by walking the layer: `docker ps
    --size`, what `docker inspect --size` reads); 0 for a session
    in no container or where Docker cannot tell."""
    container = getattr(handle, "container", None)
    if container is None:
        return 0
    try:
        listed = container.client.api.containers(all=True, size=True, filters={"id": container.id})  # GET /containers/json?size=1
        return int(listed[0].get("SizeRw") or 0) if listed else 0
    except Exception as exc:  # Docker unreachable, the container gone meanwhile
        log.debug("could not read the writable layer's size of container %s: %s", getattr(container, "id", "?"), exc)
        return 0


def over_reason(used: int, limit: int, what: str) -> str:
    """The words a session is stopped with: "used 10.3 GiB of its 10 GiB storage limit (home)"."""
    return f"used {_size(used)} of its {_size(limit)} storage limit ({what})"


def _size(n: int) -> str:
    """Binary units with one decimal where it matters: 10.3 GiB, 512 MiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f} {unit}".replace(".0 ", " ")
    return format_binary_size(n) if n else "0 B"


class StorageWatch:
    """Measures one agent's sessions' storage every `limits.storage_interval_s` seconds and stops
    those past their limits (module docstring). `agent`: the Agent (its `sessions`, each a
    RunningSession with `work_dir`, `process` and `data_dir`; its work pool, `_in` and `_stop`;
    its `usage` sampler's `notice`). `used`: {session id: bytes in its home and container layer}
    at the last measure, which agent.usage puts in its samples with `limits.session_storage`;
    `folders`: {session id: [(its folder as the session sees it, "~/data" or "~/projects/<name>",
    bytes used, bytes of its limit)]} at the last measure, sent with them too."""

    def __init__(self, agent, *, limits: SessionLimits | None = None, clock=time.monotonic) -> None:
        self.agent = agent
        self.limits = limits or SessionLimits()
        self.clock = clock
        self.used: dict[str, int] = {}
        self.folders: dict[str, list[tuple[str, int, int]]] = {}
        self._warned: set[tuple[str, str]] = set()  # (session id, "session" | a folder's name) told they near a limit
        self._partial_logged: set[str] = set()

    def configure(self, limits: SessionLimits) -> None:
        self.limits = limits

    async def run(self) -> None:
        """Measure every storage_interval_s on the work pool; stop what passed a limit."""
        while True:
            await asyncio.sleep(self.limits.storage_interval_s)
            try:
                await self.check_now()
            except Exception:
                log.exception("agent %s: measuring sessions' storage failed", self.agent.node)

    async def check_now(self) -> list[tuple[str, str]]:
        """Measure now (on the work pool), tell the sessions that near a limit, stop those past
        one. Returns [(session id, reason)] of those stopped."""
        over = await self.agent._in(self.agent._work, self.measure_all)
        for session_id, reason in over:
            log.warning("agent %s: stopping session %s: %s", self.agent.node, session_id, reason)
            await self.agent._stop(session_id, reason=reason)
        return over

    def measure_all(self) -> list[tuple[str, str]]:
        """Blocking: measure every running session and every data folder they use once. Returns
        [(session id, reason)] of the sessions past a limit."""
        sessions = dict(self.agent.sessions)
        for gone in set(self.used) - set(sessions):
            self.used.pop(gone, None)
        for gone in set(self.folders) - set(sessions):
            self.folders.pop(gone, None)
        self._warned = {key for key in self._warned if key[0] in sessions}
        over: list[tuple[str, str]] = []
        data_use: dict[Path, int] = {}  # each folder measured once a round, however many sessions mount it
        for session_id, running in sessions.items():
            home = self._measure(Path(running.work_dir))
            layer = container_layer_size(running.process)
            self.used[session_id] = home + layer
            what = "home and container layer" if getattr(running.process, "container", None) is not None else "home"
            limit = self.limits.session_storage
            if home + layer > limit:
                over.append((session_id, over_reason(home + layer, limit, what)))
                continue
            self._warn(session_id, "session", home + layer, limit, what)
            data_dir = getattr(running, "data_dir", None)
            folders = [(Path(data_dir), self.limits.user_data_storage, "~/data")] if data_dir is not None else []
            for name, folder in sorted((getattr(running, "project_dirs", None) or {}).items()):
                folders.append((Path(folder), self.limits.project_data_storage, f"~/projects/{name}"))
            for name, (folder, read_only) in sorted((getattr(running, "shared_dirs", None) or {}).items()):
                if not read_only:  # a read-write share fills its folder's limit too (a user's or a project's)
                    limit = (
                        self.limits.project_data_storage
                        if Path(folder).parent.name == "projects"
                        else self.limits.user_data_storage
                    )
                    folders.append((Path(folder), limit, f"~/shared/{name}"))
            measured = self.folders[session_id] = []
            for folder, limit, what in folders:
                if folder not in data_use:
                    data_use[folder] = self._measure(folder)
                measured.append((what, data_use[folder], limit))
                if data_use[folder] > limit:
                    over.append((session_id, over_reason(data_use[folder], limit, what)))
                    break
                self._warn(session_id, what, data_use[folder], limit, what)
        return over

    def _measure(self, root: Path) -> int:
        used, complete = measure(root)
        if not complete and str(root) not in self._partial_logged:
            self._partial_logged.add(str(root))
            log.warning("%s holds more than %d entries: its storage is measured in part (at least %s)",
                        root, MEASURE_BUDGET, _size(used))  # fmt: skip
        return used

    def _warn(self, session_id: str, kind: str, used: int, limit: int, what: str) -> None:
        if used < WARN_FRACTION * limit or (session_id, kind) in self._warned:
            return
        self._warned.add((session_id, kind))
        notice = getattr(getattr(self.agent, "usage", None), "notice", None)
        if notice is not None:
            notice(session_id, f"storage: used {_size(used)} of {_size(limit)} ({what}); the session stops past it")
