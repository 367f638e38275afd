"""Usage samples on the node: what each device and each session uses, sent to the manager in
batches (issue 15; typed as protocol.messages.UsageBatch). The agent never opens the database; the
batches travel as the Celery task `fgpu.manager.usage_report` on queue `manager.usage` (protocol),
never ahead of control messages, and the sampling runs on the agent's work pool, never on its loop,
so it never blocks a terminal.

Every `interval_s` seconds (agent.toml `[usage] interval`, default 5) one sample is taken
(`UsageSample`), typed as it travels (protocol.messages.DeviceUsage, SessionUsage, FolderUsage),
whose encoding is given here:

- per device (`devices`): `{"device": UUID, "t": epoch seconds, "memory_used": bytes,
  "memory_total": bytes, "util": percent 0-100 or None}`;
- per running session (`sessions`): `{"session_id", "t", "span": seconds this sample stands for
  (the time since the session's previous sample, at most 2 × interval, so a pause of the agent
  stays a gap and is never counted), "gpu_memory": bytes or None, "gpu_util": percent or None,
  "cpu": milli-cores (1000 = one core busy the whole span), "mem": bytes resident,
  "last_input": epoch seconds of the last terminal input or None, "storage": bytes in its home and
  container layer at the last measure (agent.storage) or None (not measured yet), "storage_limit":
  bytes, the limit the agent enforces on that figure (`[limits] session-storage`; None with no
  figure), "folders": `[{"folder": "~/data" | "~/projects/<name>", "used": bytes, "limit": bytes}]`,
  the data folders it mounts at their last measure (empty before the first)}`. The manager stores
  them (usage.SessionSample.storage, usage.FolderUse); the agent enforces the limits itself.

Where the figures come from:

- **real GPUs** (NVML, pynvml): a device's `nvmlDeviceGetMemoryInfo().used` and
  `nvmlDeviceGetUtilizationRates().gpu`; a session's GPU memory is the sum of `usedGpuMemory`
  over `nvmlDeviceGetComputeRunningProcesses` whose pid belongs to the session; its utilisation
  is the device's while it is the only session with processes on the device, else unknown (None);
- **mock devices**: what the session declares (the *usage declaration*, below); a device's memory
  used is the sum of its sessions' declared memory (at most its size), its utilisation the sum of
  their declared utilisation (at most 100);
- **CPU and memory**: the container's cgroup (v2: `cpu.stat` usage_usec, `memory.current`) where the
  session has one of its own, else its process tree (`/proc/<pid>/stat` utime + stime, `statm`
  resident pages) — every process in its process session or carrying its `FGPU_SESSION_ID`.

The usage declaration (mock nodes only; documented in README, "Usage"): a program in the session
writes the JSON file `$HOME/.fgpu-usage` (its working directory), replacing it whole, e.g.
`{"memory": "1536M", "util": 40}` — GPU memory (bytes, or a binary size "1536M", "2G") and
utilisation (percent) on each of its devices; or `{"devices": [{"memory": …, "util": …}, …]}` per
device in the session's numbering (CUDA_VISIBLE_DEVICES order). A missing file declares 0 MiB and
0 %; a file that cannot be read or parsed keeps the session's figures unknown (None) for that
sample. Nothing is enforced on a mock node: a declaration past the limit is reported as it is
(capped at the device's size only).

The host's view (`UsageSampler.processes`, issue 16 item 5; asked for, never sent unasked): which
process of which session holds how much memory of which GPU, for the node admin page and `fgpu
nodes --processes`. Real GPUs: NVML's running processes of each device (compute and graphics,
`nvmlDeviceGetComputeRunningProcesses` / `nvmlDeviceGetGraphicsRunningProcesses`; `usedGpuMemory`
in bytes), each pid matched to the session whose processes include it (the container's cgroup, else
its process tree and `FGPU_SESSION_ID`: `session_pids`); a process of no session is listed too
(session None), as the host's `nvidia-smi` lists it. Mock devices hold no process: each session
is listed once per granted device with its leader process (the shell or batch command, a
container's init) holding what the session declares (the usage declaration above) or, without a
declaration, its granted slice (`CUDA_DEVICE_MEMORY_LIMIT_<i>`), as a program that takes its
whole limit would.

A batch is sent every `flush_s` seconds (default 15; sooner once `BATCH_SAMPLES` samples wait);
while the manager cannot be reached the samples wait, the oldest dropped past `BACKLOG_SAMPLES`
(a gap in the history, never invented figures). Sending the same sample twice is harmless: the
manager stores one per (session, second) and (device, second).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from protocol.messages import DeviceUsage, FolderUsage, HardwareId, NodeName, SessionId, SessionUsage, UsageBatch
from protocol.units import SizeError, parse_binary_size
from agent.runtimes import session_processes

log = logging.getLogger(__name__)

USAGE_FILE = ".fgpu-usage"  # the mock usage declaration, in the session's home
BATCH_SAMPLES = 12  # send at once when this many samples wait
BACKLOG_SAMPLES = 720  # samples kept while the manager is unreachable (an hour at 5 s); older are dropped
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

T = TypeVar("T")


class Nvml(Protocol):
    """What is used here of NVML (the pynvml module, or a test's fake): its structs (memory info,
    utilisation rates, running processes) are read by attribute and left untyped."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object: ...
    def nvmlDeviceGetMemoryInfo(self, handle: object) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]: ...
    def nvmlSystemGetProcessName(self, pid: int) -> bytes | str: ...


class RunningSession(Protocol):
    """What is read here of one session the agent runs (agent.core.RunningSession): its runtime
    handle (`process`, whose `pid`, `container`, `pids` and `command_pid` are read where it has
    them: handles differ by runtime), its environment and its home."""

    @property
    def process(self) -> object: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def work_dir(self) -> Path: ...


class SampledAgent(Protocol):
    """What the sampler reads of its agent (agent.core.Agent): the node's name, whether it is a
    mock node, its inventory ({"devices": [DeviceInfo dicts], …}), its running sessions by id,
    the manager (whose `usage(batch)`, where it has one, receives the batches), its work pool and
    the calls that run on it and on the manager pool, and the terminal line it writes. Its `loop`
    (once started) and `storage` (agent.storage.StorageWatch) are read where present."""

    @property
    def node(self) -> str: ...
    @property
    def mock(self) -> bool: ...
    @property
    def inventory(self) -> Mapping[str, Any]: ...
    @property
    def sessions(self) -> Mapping[str, RunningSession]: ...
    @property
    def manager(self) -> object: ...
    @property
    def _work(self) -> ThreadPoolExecutor: ...
    def _in(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> Awaitable[T]: ...
    def _call(self, fn: Callable[[UsageBatch], object], batch: UsageBatch) -> Awaitable[object]: ...
    def _output(self, running: Any, text: str, *, log_it: bool = True) -> None: ...  # Any: the agent's own RunningSession


@dataclass(frozen=True)
class UsageSample:
    """One sample of the node (`UsageSampler.sample`): its devices' and its running sessions' figures
    at one time, as a usage batch carries them (see the module docstring)."""

    devices: tuple[DeviceUsage, ...] = ()
    sessions: tuple[SessionUsage, ...] = ()


def read_declaration(home: Path, device_count: int) -> list[tuple[int, int]] | None:
    """The mock usage declaration in `home` (see the module docstring) as one `(memory bytes,
    util percent)` per device of the session; [(0, 0), …] without a file; None when the file
    is unreadable or malformed (the figures are then unknown, not zero)."""
    try:
        raw = (home / USAGE_FILE).read_text()
    except FileNotFoundError:
        return [(0, 0)] * device_count
    except OSError:
        return None
    try:
        data = json.loads(raw)
        entries = data["devices"] if isinstance(data, dict) and "devices" in data else [data] * device_count
        out = []
        for i in range(device_count):
            entry = entries[i] if i < len(entries) else {}
            memory = parse_binary_size(entry.get("memory", 0))
            util = entry.get("util", 0)
            if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100:
                return None
            out.append((memory, int(util)))
        return out
    except (ValueError, TypeError, AttributeError, KeyError, SizeError):
        return None


def _cgroup_dir(pid: int, *, proc: str = "/proc", root: str = "/sys/fs/cgroup") -> Path | None:
    """The cgroup v2 directory of `pid` (a container's init), or None (v1, none, gone)."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = Path(root) / line[3:].lstrip("/")
            return path if (path / "cpu.stat").exists() else None
    return None


def cgroup_usage(directory: Path) -> tuple[float, int, set[int]] | None:
    """(CPU seconds used so far, memory bytes now, pids) of cgroup v2 `directory`; None if gone."""
    try:
        cpu = next(
            int(line.split()[1]) for line in (directory / "cpu.stat").read_text().splitlines() if line.startswith("usage_usec ")
        )
        memory = int((directory / "memory.current").read_text())
        pids = {int(p) for p in (directory / "cgroup.procs").read_text().split()}
    except (OSError, ValueError, StopIteration):
        return None
    return cpu / 1e6, memory, pids


def session_pids(session_id: str, handle: object) -> set[int]:
    """The host pids of a session's processes: its container's cgroup (`cgroup.procs`) where it
    has one of its own, else its handle's (`SessionHandle.pids`: the session's own cgroup, or its
    process tree by `runtimes.session_processes`); empty for a session without a process yet."""
    pid = getattr(handle, "pid", None)
    if not pid:
        return set()
    if getattr(handle, "container", None) is not None:
        directory = _cgroup_dir(pid)
        if directory is not None:
            try:
                return {int(p) for p in (directory / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
    return set(_tree_pids(session_id, handle))


def _tree_pids(session_id: str, handle: object) -> list[int]:
    """The live pids of a session without a container: its handle's (`SessionHandle.pids`: its
    cgroup's, or the /proc scan), or a scan from its leader `pid` for a handle without `pids`."""
    pids = getattr(handle, "pids", None)
    if pids is not None:
        found: list[int] = pids()
        return found
    pid = getattr(handle, "pid", None)
    return session_processes(session_id, pid, live_only=True) if pid else []


def command_line(pid: int, *, proc: str = "/proc", nvml: Nvml | None = None, limit: int = 256) -> str:
    """The command line of host process `pid` (its arguments joined by spaces, at most `limit`
    characters); where /proc cannot tell (gone, another pid namespace), NVML's process name
    (`nvmlSystemGetProcessName`) when `nvml` is given, else ""."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            text = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    if not text and nvml is not None:
        try:
            name = nvml.nvmlSystemGetProcessName(pid)
            text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        except Exception:
            text = ""
    return text[:limit]


def process_usage(pids: list[int], *, proc: str = "/proc") -> tuple[float, int]:
    """(CPU seconds used so far, resident bytes) summed over `pids` (those gone are skipped)."""
    cpu, rss = 0.0, 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{proc}/{pid}/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        cpu += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
        rss += pages * _PAGE
    return cpu, rss


class UsageSampler:
    """Samples one agent's devices and sessions and ships them (see the module docstring).

    `agent`: the Agent (its `sessions`, `inventory`, `mock`, work and manager pools, `manager`
    with a `usage(batch)` method (a protocol.messages.UsageBatch) — a manager without one receives nothing); `nvml`: the
    pynvml module or a fake (None: imported on first use on a real node); `clock`: epoch seconds."""

    def __init__(
        self,
        agent: SampledAgent,
        *,
        interval_s: float = 5.0,
        flush_s: float = 15.0,
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.agent = agent
        self.interval_s = interval_s
        self.flush_s = flush_s
        self.nvml = nvml
        self.clock = clock
        self.pending: collections.deque[UsageSample] = collections.deque(maxlen=BACKLOG_SAMPLES)
        self._last_input: dict[str, float] = {}
        self._cpu: dict[str, tuple[float, float]] = {}  # session → (when, CPU seconds) of its previous sample
        self._last_t: dict[str, int] = {}  # session → t of its previous sample
        self._nvml_ready = False

    def configure(self, *, interval_s: float, flush_s: float) -> None:
        self.interval_s, self.flush_s = interval_s, flush_s

    # --- hooks the agent calls ---------------------------------------------------------

    def note_input(self, session_id: str) -> None:
        """Terminal input reached the session now (the agent's loop; cheap)."""
        self._last_input[session_id] = self.clock()

    def notice(self, session_id: str, text: str) -> None:
        """Thread-safe: show `text` in the session's terminal (a line of its own, not logged):
        the manager's idle warnings (task fgpu.agent.session_notice)."""
        agent = self.agent
        running, loop = agent.sessions.get(session_id), getattr(agent, "loop", None)
        if running is None or loop is None:
            return
        # call_soon_threadsafe takes no keyword arguments: the line through a partial.
        loop.call_soon_threadsafe(functools.partial(agent._output, running, f"\r\n[fgpu: {text}]\r\n", log_it=False))

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Sample every interval_s on the work pool; ship every flush_s (or BATCH_SAMPLES)."""
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                sample = await self.agent._in(self.agent._work, self.sample)
                if sample.devices or sample.sessions:
                    self.pending.append(sample)
            except Exception:
                log.exception("agent %s: usage sampling failed", self.agent.node)
            if self.pending and (time.monotonic() - last_flush >= self.flush_s or len(self.pending) >= BATCH_SAMPLES):
                last_flush = time.monotonic()
                await self.flush()

    async def flush(self) -> bool:
        """Send what waits as one batch; False (kept for the next try) if the broker refused it."""
        send = getattr(self.agent.manager, "usage", None)
        if send is None or not self.pending:
            self.pending.clear()
            return True
        samples = list(self.pending)
        batch = UsageBatch(
            node=NodeName(self.agent.node),
            interval=self.interval_s,
            devices=tuple(d for s in samples for d in s.devices),
            sessions=tuple(x for s in samples for x in s.sessions),
        )
        try:
            await self.agent._call(send, batch)
        except Exception:
            log.warning("agent %s: could not send %d usage samples; will retry", self.agent.node, len(samples))
            return False
        for _ in samples:
            self.pending.popleft()
        return True

    # --- one sample (blocking: the work pool) ------------------------------------------------

    def sample(self) -> UsageSample:
        """One sample of every device and running session."""
        now = self.clock()
        t = int(now)
        sessions = dict(self.agent.sessions)
        for gone in set(self._last_t) - set(sessions):
            self._last_t.pop(gone, None)
            self._cpu.pop(gone, None)
            self._last_input.pop(gone, None)
        host = {sid: self._host_usage(sid, running, now) for sid, running in sessions.items()}
        if self.agent.mock:
            gpu, devices = self._mock_gpu(sessions, t)
        else:
            gpu, devices = self._nvml_gpu(sessions, {sid: h[2] for sid, h in host.items()}, t)
        watch = getattr(self.agent, "storage", None)
        storage, folders = getattr(watch, "used", {}), getattr(watch, "folders", {})
        storage_limit = watch.limits.session_storage if watch is not None else None
        rows = []
        for sid in sessions:
            cpu, mem, _ = host[sid]
            previous = self._last_t.get(sid)
            if previous == t:
                continue  # sampled this second already
            span = int(self.interval_s) if previous is None else min(t - previous, int(2 * self.interval_s))
            self._last_t[sid] = t
            memory, util = gpu.get(sid, (None, None))
            last_input = self._last_input.get(sid)
            rows.append(
                SessionUsage(
                    session_id=SessionId(sid),
                    t=t,
                    span=max(1, span),
                    gpu_memory=memory,
                    gpu_util=util,
                    cpu=cpu,
                    mem=mem,
                    last_input=None if last_input is None else int(last_input),
                    storage=storage.get(sid),  # bytes in its home and container layer (agent.storage; None: not yet)
                    storage_limit=storage_limit if sid in storage else None,
                    folders=tuple(FolderUsage(what, used, limit) for what, used, limit in folders.get(sid, ())),
                )
            )
        return UsageSample(devices=tuple(devices), sessions=tuple(rows))

    def _host_usage(self, session_id: str, running: RunningSession, now: float) -> tuple[int | None, int | None, set[int]]:
        """(CPU milli-cores since the previous sample or None at the first, resident bytes, pids)."""
        handle = running.process
        pid = getattr(handle, "pid", None)
        measured = None
        if getattr(handle, "container", None) is not None and pid:
            directory = _cgroup_dir(pid)
            measured = cgroup_usage(directory) if directory is not None else None
        if measured is None:
            found = _tree_pids(session_id, handle) if pid else []
            cpu_s, mem = process_usage(found)
            measured = (cpu_s, mem, set(found))
        cpu_s, mem, pids = measured
        before = self._cpu.get(session_id)
        self._cpu[session_id] = (now, cpu_s)
        millicores = None
        if before is not None and now > before[0]:
            millicores = max(0, int(round((cpu_s - before[1]) / (now - before[0]) * 1000)))
        return millicores, mem, pids

    @staticmethod
    def _granted(running: RunningSession) -> list[str]:
        visible = running.env.get("CUDA_VISIBLE_DEVICES", "")
        return [uuid for uuid in visible.split(",") if uuid]

    def _inventory(self) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = self.agent.inventory.get("devices", [])
        return devices

    def _mock_gpu(
        self, sessions: Mapping[str, RunningSession], t: int
    ) -> tuple[dict[str, tuple[int | None, int | None]], list[DeviceUsage]]:
        """Mock devices: the sessions' declarations, summed per device."""
        per_device: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        gpu: dict[str, tuple[int | None, int | None]] = {}
        for sid, running in sessions.items():
            granted = self._granted(running)
            declared = read_declaration(Path(running.work_dir), len(granted))
            if declared is None:
                gpu[sid] = (None, None)
                continue
            for uuid, (memory, util) in zip(granted, declared):
                per_device[uuid][0] += memory
                per_device[uuid][1] += util
            gpu[sid] = (sum(m for m, _ in declared), max((u for _, u in declared), default=0))
        devices = []
        for device in self._inventory():
            used, util = per_device.get(device["device_id"], (0, 0))
            devices.append(
                DeviceUsage(
                    device=HardwareId(device["device_id"]),
                    t=t,
                    memory_used=min(used, device["memory_size"]),
                    memory_total=device["memory_size"],
                    util=min(util, 100),
                )
            )
        return gpu, devices

    def _nvml_module(self) -> Nvml:
        """The pynvml module (or the fake given), initialised once."""
        nvml = self.nvml
        if nvml is None:
            import pynvml

            nvml = self.nvml = pynvml  # untyped (pyproject's mypy overrides): read as Nvml
        if not self._nvml_ready:
            nvml.nvmlInit()
            self._nvml_ready = True
        return nvml

    def processes(self) -> dict[str, Any]:
        """Blocking (the work pool): the host's view of the node's GPUs (see the module docstring):
        `{"source": "nvml" | "declared", "at": epoch seconds, "truncated": bool, "processes": [{"device":
        UUID, "index": the device's position in the inventory, "pid": host pid, "command": text,
        "session_id": str or None (a process of no session), "memory": bytes or None (NVML could not
        tell), "kind": "compute" | "graphics" | "declared"}, …]}`, at most protocol.MAX_NODE_PROCESSES
        rows, ordered by device then pid."""
        from protocol import MAX_NODE_PROCESSES

        sessions = dict(self.agent.sessions)
        rows = self._mock_processes(sessions) if self.agent.mock else self._nvml_processes(sessions)
        rows.sort(key=lambda r: (r["index"], r["pid"], r["kind"]))
        return {
            "source": "declared" if self.agent.mock else "nvml",
            "at": int(self.clock()),
            "truncated": len(rows) > MAX_NODE_PROCESSES,
            "processes": rows[:MAX_NODE_PROCESSES],
        }

    def _mock_processes(self, sessions: Mapping[str, RunningSession]) -> list[dict[str, Any]]:
        index = {d["device_id"]: i for i, d in enumerate(self._inventory())}
        rows = []
        for sid, running in sessions.items():
            pid = getattr(running.process, "command_pid", None) or getattr(running.process, "pid", None)  # not bwrap's
            granted = self._granted(running)
            if not pid or not granted:
                continue
            command = command_line(pid)
            has_declaration = (Path(running.work_dir) / USAGE_FILE).exists()
            declared = read_declaration(Path(running.work_dir), len(granted)) if has_declaration else None
            for i, uuid in enumerate(granted):
                if declared is not None:
                    memory = declared[i][0]
                elif has_declaration:
                    memory = None  # a declaration that cannot be read: unknown, not the slice
                else:
                    limit = running.env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{i}", "")
                    memory = int(limit[:-1]) * 2**20 if limit[:-1].isdigit() and limit.endswith("m") else None
                rows.append(
                    {
                        "device": uuid,
                        "index": index.get(uuid, len(index)),
                        "pid": pid,
                        "command": command,
                        "session_id": sid,
                        "memory": memory,
                        "kind": "declared",
                    }
                )
        return rows

    def _nvml_processes(self, sessions: Mapping[str, RunningSession]) -> list[dict[str, Any]]:
        nvml = self._nvml_module()
        owner = {pid: sid for sid, running in sessions.items() for pid in session_pids(sid, running.process)}
        rows, commands = [], {}
        for i, device in enumerate(self._inventory()):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device["device_id"])
            except Exception as exc:
                log.debug("NVML could not read %s: %s", device["device_id"], exc)
                continue
            seen = set()
            for kind, call in (
                ("compute", "nvmlDeviceGetComputeRunningProcesses"),
                ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ):
                try:
                    found = getattr(nvml, call)(handle)
                except Exception:  # not supported (a MIG device's graphics), or the driver refused
                    found = []
                for process in found:
                    pid = int(process.pid)
                    if pid in seen:  # a process both computing and drawing: listed once, as compute
                        continue
                    seen.add(pid)
                    if pid not in commands:
                        commands[pid] = command_line(pid, nvml=nvml)
                    used = getattr(process, "usedGpuMemory", None)
                    rows.append(
                        {
                            "device": device["device_id"],
                            "index": i,
                            "pid": pid,
                            "command": commands[pid],
                            "session_id": owner.get(pid),
                            "memory": None if used is None else int(used),
                            "kind": kind,
                        }
                    )
        return rows

    def _nvml_gpu(
        self, sessions: Mapping[str, RunningSession], pids: dict[str, set[int]], t: int
    ) -> tuple[dict[str, tuple[int | None, int | None]], list[DeviceUsage]]:
        """Real devices through NVML: device figures, and each session's processes' memory."""
        nvml = self._nvml_module()
        owner = {pid: sid for sid, group in pids.items() for pid in group}
        memory: dict[str, int] = collections.defaultdict(int)
        util: dict[str, int | None] = {}
        devices = []
        for device in self._inventory():
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device["device_id"])
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                log.debug("NVML could not read %s: %s", device["device_id"], exc)
                continue
            try:
                rate = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # MIG device handles have none
                rate = None
            try:
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                processes = []
            users = set()
            for process in processes:
                sid = owner.get(process.pid)
                if sid is not None:
                    memory[sid] += int(process.usedGpuMemory or 0)
                    users.add(sid)
            for sid in users:  # the device's utilisation is one session's only while it is alone there
                alone = len(users) == 1 and rate is not None and util.get(sid, 0) is not None
                util[sid] = max(rate, util.get(sid) or 0) if alone and rate is not None else None
            devices.append(
                DeviceUsage(
                    device=HardwareId(device["device_id"]),
                    t=t,
                    memory_used=int(info.used),
                    memory_total=int(info.total),
                    util=rate,
                )
            )
        # A session with no process on a GPU: 0 MiB, 0 %.
        gpu: dict[str, tuple[int | None, int | None]] = {sid: (memory.get(sid, 0), util.get(sid, 0)) for sid in sessions}
        return gpu, devices
