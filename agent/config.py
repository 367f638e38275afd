"""agent.toml: what one agent (one GPU node) runs with.

Where it overlaps it reads like Backend.AI's agent.toml, so a Backend.AI mock set-up carries
over::

    [agent]
    id = "gpu-node-1"                                   # the node's name
    allowed-compute-plugins = ["ai.backend.accelerator.mock"]
    cpu-count = 8                                       # optional; default: this machine's
    memory = "32G"                                      # optional; default: this machine's RAM
    mps = false                                         # export NVIDIA MPS limits too

    [manager]
    broker-url = "redis://127.0.0.1:6379/0"             # optional; default: $REDIS_URL
    node-key = "…"                                      # optional: signs the agent's messages (manage.py node_key)

    [container]
    scratch-root = "./var/scratches"                    # sessions' working directories
    scratch-retention = 3600                            # seconds an ended session's directory is kept
    runtime = "process"                                 # or "docker": one container per session
    default-image = "fgpu-session:latest"               # docker: the image of a session that names none (make image)
    uid = 1000                                          # whom sessions run as (docker: inside; process: on the host)
    gid = 1000                                          # process: sessions' group (default: uid)
    sandbox = "auto"                                    # process: "auto" (bubblewrap where it works, else only
                                                        #   administrators' sessions), "bubblewrap" (required),
                                                        #   "none" (UNSAFE: unconfined, a single-user machine)
    network = "outbound"                                # docker: "outbound" (internet only; old name "bridge") or "none"
                                                        # process: "none" (its default: loopback only), "outbound"
                                                        #   (slirp4netns, as root) or "host" (UNSAFE: the node's network)
    block-private-networks = true                       # outbound: sessions cannot reach private (RFC 1918) addresses
    hami-core = "/usr/local/vgpu/libvgpu.so"            # docker: enforce fractions with HAMi-core (preloaded)
    pull-images = true                                  # docker: pull an image the node lacks when a session needs it
    mps-pipe-directory = "/tmp/nvidia-mps"              # docker, with [agent] mps = true: the node's MPS pipes
    app-address = "127.0.0.1"                           # process: where session apps listen (the web hosts reach it)
    cgroup-root = "auto"                                # process: where each session gets a cgroup v2 of its own
                                                        #   ("auto": /sys/fs/cgroup or a cgroup2 mount such as
                                                        #   /sys/fs/cgroup/unified; a cgroup2 directory; "none": scan /proc)
    app-relay = "auto"                                  # docker: relay apps through the agent on app-address
                                                        #   (web hosts that cannot reach the containers' network),
                                                        #   each connection proven by the web (protocol.app_relay);
                                                        #   "auto" (default): where app-address is not loopback
    data-root = "./var/user-data"                       # users' persistent folders (~/data); shared storage (NFS) on a cluster
    terminal-direct = true                              # terminals stream directly to the web on app-address (agent.direct)
    terminal-port = 0                                   # its TCP port; 0: a free one
    terminal-address = "203.0.113.5"                    # where the web connects to it; default: app-address
                                                        #   (a node behind NAT: its forwarded address)

    [storage]                                           # where data-root is (agent.toml's data folders)
    shared = false                                      # true: data-root is a shared mount (NFS, CephFS, …), the same
                                                        #   path and contents on every node that says so; false
                                                        #   (default): this node's own disk. On a cluster the
                                                        #   scheduler keeps sessions on shared nodes where it can,
                                                        #   and tells a session on a local one that its folders
                                                        #   are local to that node (accelerators.allocation.core.storage_scope)

    [usage]
    interval = 5                                        # seconds between usage samples (1-300)
    flush = 15                                          # seconds between batches to the manager (1-3600)

    [limits]                                            # what each session may use (agent.limits, agent.storage)
    default-memory = "4G"                               # a session that asks no memory (default: 4G, at most [agent] memory)
    session-pids = 4096                                 # processes and threads of one session
    node-pids = 16384                                   # of all sessions of this agent together (process runtime)
    session-storage = "10G"                             # a session's home (scratch) and container layer
    user-data-storage = "10G"                           # a user's ~/data folder
    project-data-storage = "10G"                        # a project's data folder (~/projects/<name>)
    storage-interval = 60                               # seconds between measures of sessions' storage (5-3600)

    [plugins.mock]
    config = "mock-accelerator.toml"                    # relative to this file

Relative paths are relative to the directory of agent.toml.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from protocol.units import SizeError, parse_binary_size
from agent.network import OUTBOUND, network_mode
from agent.limits import SessionLimits
from agent.runtimes import CGROUP_AUTO, CGROUP_NONE, RUNTIMES, cgroup_tag
from agent.sandbox import NETWORK_NONE, NETWORKS, SANDBOX_AUTO, SANDBOXES

MOCK_PLUGIN = "ai.backend.accelerator.mock"
CUDA_PLUGIN = "ai.backend.accelerator.cuda"
KNOWN_PLUGINS = (MOCK_PLUGIN, CUDA_PLUGIN)


class AgentConfigError(ValueError):
    """agent.toml is unusable; the message names the file, the key and the problem."""


@dataclass(frozen=True)
class AgentConfig:
    path: Path
    node_name: str
    plugins: tuple[str, ...]
    cpu_count: int
    memory_size: int
    mps: bool
    broker_url: str
    scratch_root: Path
    mock_config: Path | None = None
    scratch_retention_s: int = 3600
    node_key: str = ""
    runtime: str = "process"
    default_image: str = "fgpu-session:latest"
    uid: int = 1000
    network: str = "outbound"  # docker: "outbound" or "none" (agent.network)
    block_private_networks: bool = True  # docker, outbound: drop sessions' traffic to private addresses
    hami_core: Path | None = None
    mps_pipe_directory: Path = Path("/tmp/nvidia-mps")
    pull_images: bool = True
    usage_interval_s: int = 5
    usage_flush_s: int = 15
    app_address: str = "127.0.0.1"
    app_relay: bool = False
    terminal_direct: bool = True  # listen for direct terminal streams on app_address (agent.direct)
    terminal_port: int = 0  # … on this port (0: a free one)
    terminal_address: str = ""  # the address the web connects to for them ("": app_address)
    data_root: Path | None = None  # users' persistent folders, `<data_root>/users/<user id>` (agent.files)
    cgroup_root: str = CGROUP_AUTO  # process runtime: "auto", "none" or an absolute cgroup2 directory
    gid: int = 1000  # process runtime: sessions' group on the host
    sandbox: str = SANDBOX_AUTO  # process runtime: "auto", "bubblewrap" or "none" (agent.sandbox)
    limits: SessionLimits = field(default_factory=SessionLimits)  # [limits] (agent.limits)
    storage_shared: bool = False  # [storage] shared: data-root is a shared mount (protocol.messages.NodeStorage)
    extra: dict = field(default_factory=dict)

    @property
    def pulls_images(self) -> bool:
        """Whether sessions may be placed here in an image the node does not hold yet (the docker
        runtime pulls it from its registry)."""
        return self.runtime == "docker" and self.pull_images

    @property
    def fraction_enforcement(self) -> str:
        """What holds a session to its GPU fraction on this node: "hami-core" (the docker runtime
        preloads HAMi-core, which reads CUDA_DEVICE_MEMORY_LIMIT_<i> / CUDA_DEVICE_SM_LIMIT), "mps"
        (NVIDIA MPS: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT / CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) or "none"
        (the limits are only in the environment: a program may use the whole device)."""
        if self.runtime == "docker" and self.hami_core is not None:
            return "hami-core"
        return "mps" if self.mps else "none"


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def load_agent_config(path: str | Path, *, default_broker: str = "", runtime: str | None = None) -> AgentConfig:
    """Read and check agent.toml. `runtime`: the runtime to read it for instead of its `[container]
    runtime` (standalone's FGPU_RUNTIME), so that that runtime's defaults apply (its network).
    Raises AgentConfigError naming the file and key."""
    path = Path(path).resolve()
    where = path.name

    def fail(key: str, problem: str):
        raise AgentConfigError(f"{where}: {key}: {problem}")

    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise AgentConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"{where}: not valid TOML: {exc}") from None

    def table(parent: dict, key: str, where_key: str) -> dict:
        value = parent.get(key, {})
        if not isinstance(value, dict):
            fail(where_key, f"expected a table, got {value!r}")
        return value

    def text(parent: dict, key: str, where_key: str, default: str) -> str:
        value = parent.get(key, default)
        if not isinstance(value, str):
            fail(where_key, f"expected text, got {value!r}")
        return value

    agent = table(data, "agent", "agent")
    node_name = agent.get("id", socket.gethostname())
    if not isinstance(node_name, str) or not node_name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        fail("agent.id", f"{node_name!r} is not a node name (letters, digits, '-', '_', '.')")
    plugins = agent.get("allowed-compute-plugins", [MOCK_PLUGIN])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        fail("agent.allowed-compute-plugins", "expected a list of plugin names")
    for plugin in plugins:
        if plugin not in KNOWN_PLUGINS:
            fail("agent.allowed-compute-plugins", f"unknown plugin {plugin!r} (known: {', '.join(KNOWN_PLUGINS)})")
    cpu_count = agent.get("cpu-count", os.cpu_count() or 1)
    if isinstance(cpu_count, bool) or not isinstance(cpu_count, int) or cpu_count < 1:
        fail("agent.cpu-count", f"{cpu_count!r} is not a positive whole number")
    try:
        memory_size = parse_binary_size(agent.get("memory", _machine_memory()))
    except SizeError as exc:
        fail("agent.memory", str(exc))
    mps = agent.get("mps", False)
    if not isinstance(mps, bool):
        fail("agent.mps", "expected true or false")
    manager = table(data, "manager", "manager")
    broker_url = text(manager, "broker-url", "manager.broker-url", default_broker)
    node_key = text(manager, "node-key", "manager.node-key", os.environ.get("FGPU_NODE_KEY", ""))
    if broker_url and not broker_url.startswith(("redis://", "rediss://", "memory://")):
        fail("manager.broker-url", f"{broker_url!r} is not a redis:// URL")
    container = table(data, "container", "container")
    scratch = text(container, "scratch-root", "container.scratch-root", "scratches")
    retention = container.get("scratch-retention", 3600)
    if isinstance(retention, bool) or not isinstance(retention, int) or not 0 <= retention <= 365 * 86400:
        fail("container.scratch-retention", f"{retention!r} is not a number of seconds from 0 to 31536000")
    runtime = runtime or text(container, "runtime", "container.runtime", "process")
    if runtime not in RUNTIMES:
        fail("container.runtime", f"{runtime!r} is not a runtime (known: {', '.join(RUNTIMES)})")
    default_image = text(container, "default-image", "container.default-image", "fgpu-session:latest")
    uid = container.get("uid", 1000)
    if isinstance(uid, bool) or not isinstance(uid, int) or not 1 <= uid <= 65534:
        fail("container.uid", f"{uid!r} is not a user id from 1 to 65534 (sessions never run as root)")
    gid = container.get("gid", uid)
    if isinstance(gid, bool) or not isinstance(gid, int) or not 1 <= gid <= 65534:
        fail("container.gid", f"{gid!r} is not a group id from 1 to 65534 (sessions never run as root)")
    sandbox = text(container, "sandbox", "container.sandbox", SANDBOX_AUTO)
    if sandbox not in SANDBOXES:
        fail("container.sandbox", f"{sandbox!r}: expected one of {', '.join(SANDBOXES)}")
    if runtime == "process":  # the process runtime: its own loopback, the internet (slirp4netns), or the node's network
        network = text(container, "network", "container.network", NETWORK_NONE)
        if network not in NETWORKS:
            fail(
                "container.network",
                f'{network!r}: the process runtime takes "none" (loopback only), "outbound" or "host" (UNSAFE)',
            )
    else:
        try:
            network = network_mode(text(container, "network", "container.network", OUTBOUND))
        except ValueError as exc:
            fail("container.network", str(exc))
    block_private = container.get("block-private-networks", True)
    if not isinstance(block_private, bool):
        fail("container.block-private-networks", "expected true or false")
    hami_core = None
    if "hami-core" in container:
        hami_core = (path.parent / text(container, "hami-core", "container.hami-core", "")).resolve()
        if not hami_core.is_file():
            fail("container.hami-core", f"{hami_core} is not a file (HAMi-core's libvgpu.so)")
    mps_pipes = Path(text(container, "mps-pipe-directory", "container.mps-pipe-directory", "/tmp/nvidia-mps"))
    if not mps_pipes.is_absolute():
        fail("container.mps-pipe-directory", f"{str(mps_pipes)!r} is not an absolute path")
    pull_images = container.get("pull-images", True)
    if not isinstance(pull_images, bool):
        fail("container.pull-images", "expected true or false")
    app_relay = container.get("app-relay", "auto")
    if not isinstance(app_relay, bool) and app_relay != "auto":
        fail("container.app-relay", 'expected "auto", true or false')
    app_address = text(container, "app-address", "container.app-address", "127.0.0.1")
    try:
        socket.getaddrinfo(app_address, None, proto=socket.IPPROTO_TCP, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        fail("container.app-address", f"{app_address!r} is not an IP address (where session apps listen)")
    if app_relay == "auto":  # the web on another host cannot reach this node's container network: relay
        app_relay = not ipaddress.ip_address(app_address).is_loopback
    terminal_direct = container.get("terminal-direct", True)
    if not isinstance(terminal_direct, bool):
        fail("container.terminal-direct", "expected true or false")
    terminal_port = container.get("terminal-port", 0)
    if isinstance(terminal_port, bool) or not isinstance(terminal_port, int) or not 0 <= terminal_port <= 65535:
        fail("container.terminal-port", f"{terminal_port!r} is not a TCP port from 0 (a free one) to 65535")
    terminal_address = text(container, "terminal-address", "container.terminal-address", "")
    if terminal_address:
        try:
            socket.getaddrinfo(terminal_address, None, proto=socket.IPPROTO_TCP, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            fail("container.terminal-address", f"{terminal_address!r} is not an IP address (where the web reaches the agent)")
    data_root = (path.parent / text(container, "data-root", "container.data-root", "user-data")).resolve()
    cgroup_root = text(container, "cgroup-root", "container.cgroup-root", CGROUP_AUTO)
    if cgroup_root not in (CGROUP_AUTO, CGROUP_NONE) and not Path(cgroup_root).is_absolute():
        fail("container.cgroup-root", f'{cgroup_root!r}: expected "auto", "none" or an absolute path (a cgroup v2 directory)')
    try:
        cgroup_tag()
    except ValueError as exc:
        raise AgentConfigError(str(exc)) from None
    limits_table = table(data, "limits", "limits")

    def size(key: str, default: int, least: int) -> int:
        try:
            value = parse_binary_size(limits_table.get(key, default))
        except SizeError as exc:
            fail(f"limits.{key}", str(exc))
        if value < least:
            fail(f"limits.{key}", f"{limits_table[key]!r} is less than {least >> 20} MiB")
        return value

    def count(key: str, default: int, least: int, most: int) -> int:
        value = limits_table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            fail(f"limits.{key}", f"{value!r} is not a whole number from {least} to {most}")
        return value

    default_memory = min(SessionLimits.default_memory, memory_size or SessionLimits.default_memory)  # 4 GiB, or the node's
    limits = SessionLimits(
        default_memory=size("default-memory", default_memory, 16 << 20),
        session_pids=count("session-pids", SessionLimits.session_pids, 16, 4_194_304),
        node_pids=count("node-pids", SessionLimits.node_pids, 16, 4_194_304),
        session_storage=size("session-storage", SessionLimits.session_storage, 1 << 20),
        user_data_storage=size("user-data-storage", SessionLimits.user_data_storage, 1 << 20),
        project_data_storage=size("project-data-storage", SessionLimits.project_data_storage, 1 << 20),
        storage_interval_s=count("storage-interval", SessionLimits.storage_interval_s, 5, 3600),
    )
    storage = table(data, "storage", "storage")
    storage_shared = storage.get("shared", False)
    if not isinstance(storage_shared, bool):
        fail("storage.shared", "expected true (data-root is a shared mount such as NFS) or false (this node's disk)")
    unknown = sorted(set(storage) - {"shared"})
    if unknown:
        fail(f"storage.{unknown[0]}", "unknown key (known: shared)")
    usage = table(data, "usage", "usage")
    usage_interval = usage.get("interval", 5)
    if isinstance(usage_interval, bool) or not isinstance(usage_interval, int) or not 1 <= usage_interval <= 300:
        fail("usage.interval", f"{usage_interval!r} is not a number of seconds from 1 to 300")
    usage_flush = usage.get("flush", 15)
    if isinstance(usage_flush, bool) or not isinstance(usage_flush, int) or not 1 <= usage_flush <= 3600:
        fail("usage.flush", f"{usage_flush!r} is not a number of seconds from 1 to 3600")
    mock_config = None
    if MOCK_PLUGIN in plugins:
        mock = table(table(data, "plugins", "plugins"), "mock", "plugins.mock")
        raw = text(mock, "config", "plugins.mock.config", "mock-accelerator.toml")
        mock_config = (path.parent / raw).resolve()
        if not mock_config.exists():
            fail("plugins.mock.config", f"{mock_config} does not exist")
    return AgentConfig(
        path=path,
        node_name=node_name,
        plugins=tuple(plugins),
        cpu_count=cpu_count,
        memory_size=memory_size,
        mps=mps,
        broker_url=broker_url,
        scratch_root=(path.parent / scratch).resolve(),
        mock_config=mock_config,
        scratch_retention_s=retention,
        node_key=node_key,
        runtime=runtime,
        default_image=default_image,
        uid=uid,
        network=network,
        block_private_networks=block_private,
        hami_core=hami_core,
        mps_pipe_directory=mps_pipes,
        pull_images=pull_images,
        usage_interval_s=usage_interval,
        usage_flush_s=usage_flush,
        app_address=app_address,
        app_relay=app_relay,
        terminal_direct=terminal_direct,
        terminal_port=terminal_port,
        terminal_address=terminal_address,
        data_root=data_root,
        cgroup_root=cgroup_root,
        gid=gid,
        sandbox=sandbox,
        limits=limits,
        storage_shared=storage_shared,
    )
