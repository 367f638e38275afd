"""The process runtime's sandbox (issue 31, item 2): every session runs under bubblewrap
(`bwrap`, Debian's), as an unprivileged host user that is never the agent's, in its own user,
mount, PID, IPC, UTS and network namespaces.

What a session sees (`Sandbox.command`): the host system read-only (/usr, /etc and the /bin, /lib…
links or directories), a fresh /dev (with, of the NVIDIA device nodes, only the control nodes and
its granted GPUs': `gpu_devices`), /tmp and a /proc of its own PID namespace; its home (the
session's working directory) read-write at the same path it has on the host, so the paths in its
environment (FGPU_ALLOCATION, the virtual nvidia-smi's `<work_dir>/.fgpu/bin`) hold; its data
folders (`~/data`, `~/projects/<name>`: symbolic links to folders under the data root, bound at
their own paths) read-write, and the folders shared with its owner read-only or read-write as each
share says (`~/shared/<name>`, issue 36.5: a read-only one is bound with --ro-bind, which the
session, holding no capability outside its user namespace, cannot remount); and read-only what the
virtual nvidia-smi and the host image's apps (JupyterLab) run with: the agent's Python
(`sys.base_prefix`, `sys.prefix`: the venv) and the `agent` package. Nothing else: no agent.toml,
no FGPU_DATA_DIR (the console's database, other sessions' homes), no host /proc, no Docker socket,
no /run, no /var, no /home. The network is only loopback (agent.toml `[container] network =
"none"`, the default) or, with "outbound", the internet through slirp4netns and nothing of the
node, link-local or (`block-private-networks`) private addresses (agent.network's second part;
`Sandbox.attach_network`); "host" is the node's network (UNSAFE: Redis, PostgreSQL, the web and
the agent in reach).

Who it runs as: an agent that is root drops to agent.toml's `[container] uid`/`gid` (setpriv:
no supplementary groups, no capabilities, no_new_privs) before it execs bwrap, which then
creates the user namespace as that user (uid and gid mapped to themselves). That user cannot
traverse what the agent can (its Python under /root, a data root of mode 0700), so first, still
root, the leader stages every bind source in a mount namespace of its own (util-linux `unshare
--mount --propagation private`: nothing is seen outside it): a tmpfs on STAGE_POINT, each source
bind-mounted under it (STAGE_SCRIPT), from where bwrap binds them to their own paths. An agent
that is not root cannot switch users: the session runs as the agent's user, in bwrap's user
namespace, seeing only its own paths (logged at start).

Where bwrap cannot run (not installed, user namespaces off), `probe` says why once at the
agent's start: agent.toml's `[container] sandbox` then decides: "auto" (the default) runs
administrators' sessions unconfined and refuses others' with the reason; "bubblewrap" makes the
agent refuse to start; "none" runs every session unconfined (UNSAFE: a single-user machine,
logged loudly at start).

Beside a session (`Sandbox.enter`): util-linux `nsenter` into the namespaces of the sandbox's
init (bwrap's child, its pid read from bwrap's `--json-status-fd`), as the session's uid and gid,
in the session's working directory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import logging
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.messages import HardwareId, StartSpec
from agent.network import SLIRP_MTU, SLIRP_TAP, host_addresses, host_nameservers, session_ruleset

log = logging.getLogger(__name__)

SANDBOX_AUTO = "auto"  # bubblewrap where it works; without it only administrators' sessions run
SANDBOX_BUBBLEWRAP = "bubblewrap"  # required: the agent refuses to start without it
SANDBOX_NONE = "none"  # UNSAFE: sessions run unconfined, as the agent's user (a single-user machine)
SANDBOXES = (SANDBOX_AUTO, SANDBOX_BUBBLEWRAP, SANDBOX_NONE)
NETWORK_HOST = "host"  # process runtime, UNSAFE: sessions share the node's network
NETWORK_NONE = "none"  # process runtime: only loopback of the session's own (its default)
NETWORK_OUTBOUND = "outbound"  # process runtime: the internet through slirp4netns, nothing of the node (agent.network)
NETWORKS = (NETWORK_NONE, NETWORK_OUTBOUND, NETWORK_HOST)
SLIRP_READY_TIMEOUT_S = 10.0  # how long a spawn waits for slirp4netns to say the session's network is up
NFT_TIMEOUT_S = 10.0
STAGE_POINT = Path("/run/fgpu-sandbox")  # an empty directory: a tmpfs goes on it in each leader's own mount namespace
STATUS_TIMEOUT_S = 10.0  # how long a spawn waits for bwrap to say its sandbox's init runs
PROBE_TIMEOUT_S = 20.0
SYSTEM_READ_ONLY = ("/usr", "/etc")  # bound read-only at their own paths
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symbolic links (merged /usr) or directories
# Run by root in the leader's own mount namespace: `$1` the stage point, `$2` how many sources
# follow; each source is bind-mounted on `<stage>/<i>` (one mount(8) each, which makes the
# directory: X-mount.mkdir), then the rest (setpriv … bwrap …) is exec'd. mount(8) answers for
# itself on stderr (the session's terminal) and the leader exits 125.
STAGE_SCRIPT = (
    's=$1; n=$2; shift 2; mount -t tmpfs -o mode=0755,size=16k fgpu-stage "$s" || exit 125; i=0; '
    'while [ "$i" -lt "$n" ]; do mount --bind -o X-mount.mkdir "$1" "$s/$i" || exit 125; shift; i=$((i + 1)); done; '
    'exec "$@"'
)
# Run inside a sandbox by an exec (Sandbox.enter), before its command: into the working directory
# `$1`, looked up inside (the shell started with the node's: nsenter keeps the caller's).
ENTER_SCRIPT = 'cd -- "$1" || exit 125; shift; exec "$@"'
SETUP_POLL_S = 0.001  # between looks at whether a sandbox's init has started its command (wait_set_up)
CLONE_NEWNET = 0x40000000
NVIDIA_PROC = "/proc/driver/nvidia"  # the NVIDIA driver's: gpus/<PCI bus id>/information (gpu_minors' fallback)
# Every CUDA process opens these (nvidia-container-toolkit's list of control devices); a GPU's own node is nvidia<minor>.
GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
MIG_CAPS_DIR = "nvidia-caps"  # /dev/nvidia-caps/nvidia-cap<N>: MIG's GPU and compute instance capabilities
NS_GET_USERNS = 0xB701  # ioctl_ns(2): a descriptor of the user namespace that owns a namespace

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(RuntimeError):
    """A session cannot start confined (bwrap said why, or did not say its init's pid in time)."""


@dataclass(frozen=True)
class Sandbox:
    """How the process runtime confines sessions: `bwrap`, `setpriv`, `unshare`, `nsenter`:
    the tools' paths; `uid`/`gid`: whom sessions run as (the agent's own where `drop` is False:
    the agent is not root); `share_net`: the node's network (agent.toml network "host", UNSAFE);
    `read_only`: host directories every session sees read-only at their own paths (the agent's
    Python and `agent` package); `slirp4netns`, `nft`: those tools' paths where sessions get the
    outbound network (agent.toml network "outbound", `attach_network`), else "";
    `block_private`: outbound sessions cannot reach private addresses either."""

    bwrap: str
    setpriv: str
    unshare: str
    nsenter: str
    uid: int
    gid: int
    drop: bool
    share_net: bool
    read_only: tuple[str, ...]
    slirp4netns: str = ""
    nft: str = ""
    block_private: bool = True

    @property
    def outbound(self) -> bool:
        """Whether sessions get the outbound network (`attach_network` before their command runs)."""
        return bool(self.slirp4netns and self.nft) and not self.share_net

    def command(
        self,
        argv: list[str],
        *,
        home: Path,
        data: list[Path],
        status_fd: int,
        block_fd: int = -1,
        devices: Sequence[str] = (),
        read_only_data: Sequence[Path] = (),
    ) -> list[str]:
        """The leader's command (after it joined its cgroup and took its terminal) that runs
        `argv` in the sandbox: `home` (the working directory) and `data` (folders) read-write at
        their own paths, `read_only` and the host system read-only; bwrap writes its sandbox's
        init pid as JSON on `status_fd` (`{"child-pid": N, …}`, a line) and, at the end, the
        exit code (`{"exit-code": N}`). With `block_fd` (a pipe's read end), the init waits, its
        sandbox set up, until a byte arrives there (or its write end closes) before it starts
        `argv` (bwrap's --block-fd): where the outbound network is attached. `read_only_data`:
        folders bound read-only at their own paths (read-only shares; one also in `data` is
        bound read-only). `devices`: the device
        nodes the session gets (`gpu_devices`: the NVIDIA control nodes and its granted GPUs'),
        bound at their own paths; the fresh /dev has no other. Only the sources the
        session's user cannot reach itself (`searchable`) are staged: each costs the leader a
        mount(8), and with none to stage the leader runs no mount namespace of its own (the
        launch's cost, issue 14)."""
        read_only = {str(folder) for folder in read_only_data}
        writable = [str(home), *(str(folder) for folder in data if str(folder) not in read_only)]
        sources = [*self.read_only, *writable, *sorted(read_only)]
        hidden = [src for src in sources if self.drop and not searchable(src, self.uid, self.gid)]
        stage = {src: str(STAGE_POINT / str(i)) for i, src in enumerate(hidden)}
        staged = [stage.get(src, src) for src in sources]
        args = [self.bwrap, "--unshare-all", "--die-with-parent"]
        if self.share_net:
            args.append("--share-net")
        for directory in SYSTEM_READ_ONLY:
            args += ["--ro-bind", directory, directory]
        for entry in SYSTEM_LINKS:
            if os.path.islink(entry):
                args += ["--symlink", os.readlink(entry), entry]
            elif os.path.isdir(entry):
                args += ["--ro-bind", entry, entry]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for device in devices:
            args += ["--dev-bind", device, device]
        for source, dest in zip(staged, sources, strict=True):
            args += ["--ro-bind" if dest in self.read_only or dest in read_only else "--bind", source, dest]
        args += ["--chdir", str(home), "--json-status-fd", str(status_fd)]
        if block_fd >= 0:
            args += ["--block-fd", str(block_fd)]
        args += ["--", *argv]
        if not self.drop:
            return args
        drop = [self.setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--no-new-privs"]
        drop += ["--inh-caps=-all", "--bounding-set=-all", "--"]
        if not hidden:
            return [*drop, *args]
        staging = [self.unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", STAGE_SCRIPT, "fgpu-stage"]
        return [*staging, str(STAGE_POINT), str(len(hidden)), *hidden, *drop, *args]

    def enter(self, init_pid: int, argv: list[str], *, cwd: Path) -> list[str]:
        """The command that runs `argv` inside the sandbox whose init is `init_pid` (host pid):
        its user, mount, PID, network, IPC and UTS namespaces and root, as the session's uid and
        gid (no capabilities: not root in its user namespace), with no_new_privs, in `cwd` as the
        sandbox sees it (ENTER_SCRIPT's cd; exit status 125 where it cannot). Not nsenter's
        --wd: it opens the directory on the node before it enters, and a working directory of
        the node's tree lets `cd -P ..` climb the node's file system past the sandbox's root."""
        who = [f"--setuid={self.uid}", f"--setgid={self.gid}"] if self.drop else ["--preserve-credentials"]
        return [
            self.nsenter, f"--target={init_pid}", "--user", "--mount", "--pid", "--net", "--ipc", "--uts",
            *who, "--root", "--", self.setpriv, "--no-new-privs", "--",
            "/bin/sh", "-c", ENTER_SCRIPT, "fgpu-exec", str(cwd), *argv,
        ]  # fmt: skip

    def attach_network(self, init_pid: int, *, exit_fd: int = -1) -> SlirpNetwork:
        """Blocking, ~20 ms: give the network namespace of the sandbox whose init is `init_pid`
        (waiting on its --block-fd) the outbound network: slirp4netns attached to it (as root,
        `--enable-sandbox --enable-seccomp`: its own empty root and mount namespace, no
        capability but CAP_NET_BIND_SERVICE, a seccomp filter; `--disable-host-loopback`;
        it ends when its `--exit-fd` closes: SlirpNetwork.close, or this process's end; with
        `exit_fd`, a pipe's read end whose write end another process holds (a session's holder,
        agent.holder), when that one's copy closes: the caller closes `exit_fd`), then
        agent.network.session_ruleset installed inside (util-linux nsenter, nft). Raises
        SandboxError with the tool's words (slirp4netns killed again)."""
        wait_loopback(init_pid)
        try:  # the namespace and the user namespace that owns it (bwrap's first: its init moved on to a second, inner one)
            netns = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"the sandbox's network namespace is gone: {exc.strerror or exc}") from None
        try:
            owner = fcntl.ioctl(netns, NS_GET_USERNS)
        except OSError as exc:
            os.close(netns)
            raise SandboxError(f"the owner of the sandbox's network namespace: {exc.strerror or exc}") from None
        exit_read, exit_write = (exit_fd, -1) if exit_fd >= 0 else os.pipe()
        ready_read, ready_write = os.pipe()
        argv = [
            self.slirp4netns, "--configure", f"--mtu={SLIRP_MTU}", "--disable-host-loopback", "--enable-sandbox",
            "--enable-seccomp", f"--exit-fd={exit_read}", f"--ready-fd={ready_write}", "--netns-type=path",
            f"--userns-path=/proc/self/fd/{owner}", f"/proc/self/fd/{netns}", SLIRP_TAP,
        ]  # fmt: skip
        try:
            slirp = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(exit_read, ready_write, netns, owner), start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            for fd in (exit_read, exit_write, ready_read, ready_write):
                if fd >= 0 and fd != exit_fd:
                    os.close(fd)
            raise SandboxError(f"slirp4netns could not be started: {exc}") from None
        finally:
            os.close(netns)
            os.close(owner)
        if exit_fd < 0:
            os.close(exit_read)
        os.close(ready_write)
        network = SlirpNetwork(slirp, exit_write)
        try:
            ready, _, _ = select.select([ready_read], [], [], SLIRP_READY_TIMEOUT_S)
            if not ready or os.read(ready_read, 1) != b"1":
                raise SandboxError(f"slirp4netns did not set up the session's network: {network.said()}")
            rules = session_ruleset(host=host_addresses(), nameservers=host_nameservers(), block_private=self.block_private)
            try:
                done = subprocess.run(
                    [self.nsenter, f"--target={init_pid}", "--net", "--", self.nft, "-f", "-"],
                    input=rules.encode(), capture_output=True, timeout=NFT_TIMEOUT_S,
                )  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SandboxError(f"the session's network rules could not be installed: {exc}") from None
            if done.returncode:
                said = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
                raise SandboxError(f"the session's network rules could not be installed: {said}")
        except BaseException:
            network.close()
            raise
        finally:
            os.close(ready_read)
        return network

    def own(self, *paths: Path) -> None:
        """Blocking: give each of `paths` (not following links) to the session's uid and gid,
        where the agent may (it is root); a path that is gone is skipped."""
        if not self.drop:
            return
        for path in paths:
            try:
                os.chown(path, self.uid, self.gid, follow_symlinks=False)
            except FileNotFoundError:
                continue


class SlirpNetwork:
    """A session's outbound network (Sandbox.attach_network): its slirp4netns process, which ends
    when `close()` closes the write end of its --exit-fd (or this process ends)."""

    def __init__(self, process: subprocess.Popen, exit_fd: int) -> None:
        self.process = process
        self._exit_fd = exit_fd  # -1: another process holds it (a session's holder), and slirp4netns ends with that one

    def said(self) -> str:
        """Blocking: what slirp4netns wrote on stderr, once it ended (killed first), last 1 kB."""
        self.close(wait=0.0)
        text = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
        return text.strip()[-1024:] or f"exit status {self.process.returncode}"

    def close(self, *, wait: float = 2.0) -> None:
        """Blocking, a few ms: end slirp4netns (its exit fd closed; killed after `wait` seconds) and reap it."""
        if self._exit_fd >= 0:
            os.close(self._exit_fd)
            self._exit_fd = -1
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def searchable(path: str, uid: int, gid: int) -> bool:
    """Blocking, a stat per directory above `path` (an absolute path): whether a process of `uid`
    and `gid` alone (no supplementary groups: setpriv --clear-groups) may look `path` up, i.e.
    bind-mount it: no symbolic link on the way and search (x) permission on every directory
    above it. False where one is gone or unreadable."""
    if os.path.realpath(path) != os.path.normpath(path):
        return False
    parent = os.path.dirname(os.path.normpath(path))
    while True:
        try:
            info = os.stat(parent)
        except OSError:
            return False
        if info.st_uid == uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


@dataclass(frozen=True)
class GpuGrant:
    """A GPU or MIG device granted to a session, as its start spec names it: `uuid` (the wire's
    `device_id`, its hardware id: "GPU-…" or "MIG-…"), `mig` (the spec's `is_mig_device`) and, for
    a MIG device, `parent`: its GPU's hardware id where the spec says it (its `mig` block's `gpu`),
    else ""."""

    uuid: HardwareId
    mig: bool = False
    parent: HardwareId = HardwareId("")


def spec_gpus(spec: StartSpec) -> tuple[GpuGrant, ...]:
    """The devices of start spec `spec` (after agent.mig.prepare_spec): one GpuGrant per device
    with a hardware id. A MIG device's parent is the `mig` block's `gpu` where the spec has one
    MIG device (the block's instance); otherwise it is left for NVML to say
    (nvmlDeviceGetDeviceHandleFromMigDeviceHandle)."""
    devices = [d for d in spec.devices if d.hardware_id]
    migs = sum(1 for d in devices if d.is_mig_device)
    parent = spec.mig.gpu if spec.mig is not None and migs == 1 else HardwareId("")
    return tuple(
        GpuGrant(d.hardware_id, mig=True, parent=parent) if d.is_mig_device else GpuGrant(d.hardware_id) for d in devices
    )


def gpu_devices(grants: Sequence[GpuGrant] = (), *, dev: str = "/dev", drivers: str = NVIDIA_PROC, nvml: Any = None) -> list[str]:
    """Blocking, one NVML session (or a few small reads of `drivers`): the NVIDIA device nodes a
    session granted `grants` gets, as the docker runtime's container gets only its granted devices
    from the NVIDIA container toolkit: the control nodes present in `dev` (GPU_CONTROL_NODES) and
    `<dev>/nvidia<minor>` of each granted GPU, where `minor` is the GPU's device minor number
    (`gpu_minors`); for a MIG device, its parent GPU's node and `<dev>/nvidia-caps` (the MIG
    capability nodes: NOT narrowed yet to the device's own GPU and compute instance caps, so a
    MIG session holds every MIG capability of the node; CUDA_VISIBLE_DEVICES and the virtual
    nvidia-smi name its own). A grant whose node cannot be found is logged and left out, never
    replaced by all nodes. [] for a session without grants and on a node without
    `<dev>/nvidiactl` (no NVIDIA driver: the mock plugin), where nothing is looked up."""
    if not grants or not os.path.exists(os.path.join(dev, "nvidiactl")):
        return []
    found = [os.path.join(dev, name) for name in GPU_CONTROL_NODES if os.path.exists(os.path.join(dev, name))]
    minors = gpu_minors(grants, drivers=drivers, nvml=nvml)
    for grant in grants:
        minor = minors.get(grant.uuid)
        node = os.path.join(dev, f"nvidia{minor}") if minor is not None else ""
        if not node or not os.path.exists(node):
            log.warning(
                "the session starts without %s: %s", grant.uuid,
                f"{node} does not exist" if node else "its device minor number was not found (NVML or /proc/driver/nvidia)",
            )  # fmt: skip
        elif node not in found:
            found.append(node)
    caps = os.path.join(dev, MIG_CAPS_DIR)
    if any(grant.mig for grant in grants) and os.path.exists(caps):
        found.append(caps)
    return found


def gpu_minors(grants: Sequence[GpuGrant], *, drivers: str = NVIDIA_PROC, nvml: Any = None) -> dict[str, int]:
    """Blocking: grant UUID → the device minor number of its GPU (a MIG device's: its parent
    GPU's, the /dev/nvidia<minor> node that opens it), by NVML (`nvml`: the pynvml module, or a
    fake; None: pynvml imported here): nvmlDeviceGetHandleByUUID, for a MIG handle
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle, then nvmlDeviceGetMinorNumber, in one
    nvmlInit/nvmlShutdown. Where NVML cannot be loaded or does not know a UUID, the driver's
    `<drivers>/gpus/*/information` files ("GPU UUID:" and "Device Minor:" lines; a MIG device by
    its `parent` only). UUIDs found nowhere are absent; never raises."""
    minors: dict[str, int] = {}
    library = nvml
    try:
        if library is None:
            import pynvml

            library = pynvml
        library.nvmlInit()
    except Exception as exc:  # pynvml's NVMLError_LibraryNotFound (no driver), ImportError: the files then
        log.debug("NVML cannot be loaded (%s); device minor numbers from %s", exc, drivers)
        library = None
    if library is not None:
        try:
            for grant in grants:
                minor = _nvml_minor(library, grant.uuid)
                if minor is None and grant.parent:  # a MIG device NVML does not know (yet): its GPU's
                    minor = _nvml_minor(library, grant.parent)
                if minor is not None:
                    minors[grant.uuid] = minor
        finally:
            try:
                library.nvmlShutdown()
            except Exception as exc:  # its NVMLError: nothing to undo
                log.debug("nvmlShutdown: %s", exc)
    missing = [grant for grant in grants if grant.uuid not in minors]
    if missing:
        table = driver_minors(drivers)
        for grant in missing:
            minor = table.get(grant.parent if grant.mig else grant.uuid)
            if minor is not None:
                minors[grant.uuid] = minor
    return minors


def _nvml_minor(nvml: Any, uuid: str) -> int | None:
    """The device minor number of the GPU of `uuid` (a MIG device's: its parent GPU's) by NVML
    (initialised), or None where NVML does not say (it logs why at debug level)."""
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        if uuid.startswith("MIG-") and nvml.nvmlDeviceIsMigDeviceHandle(handle):
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return int(nvml.nvmlDeviceGetMinorNumber(handle))
    except Exception as exc:  # NVMLError (NOT_FOUND, GPU_IS_LOST, …), or an old pynvml's TypeError on str
        log.debug("NVML does not give the device minor number of %s: %s", uuid, exc)
        return None


def driver_minors(drivers: str = NVIDIA_PROC) -> dict[str, int]:
    """Blocking, a read per GPU: GPU UUID → device minor number, from the NVIDIA driver's
    `<drivers>/gpus/<PCI bus id>/information` (its lines "GPU UUID: GPU-…" and "Device Minor: N");
    {} where there are none (no driver). A file without both lines, or unreadable, is skipped."""
    table: dict[str, int] = {}
    for info in sorted(Path(drivers, "gpus").glob("*/information")):
        try:
            fields = dict(line.split(":", 1) for line in info.read_text(errors="replace").splitlines() if ":" in line)
            table[fields["GPU UUID"].strip()] = int(fields["Device Minor"].strip())
        except (OSError, KeyError, ValueError):
            continue
    return table


def read_init_pid(status_fd: int, *, timeout: float = STATUS_TIMEOUT_S) -> int:
    """Blocking: the host pid of a sandbox's init, from the first line bwrap writes on its
    `--json-status-fd` (read end `status_fd`, left open: bwrap writes its exit code there at the
    end). Raises SandboxError when bwrap ends first (it said why on the session's terminal) or
    says nothing within `timeout` seconds."""
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([status_fd], [], [], timeout)
        if not ready:
            raise SandboxError(f"the sandbox did not start within {timeout:g} s")
        chunk = os.read(status_fd, 4096)
        if not chunk:
            raise SandboxError("the sandbox could not be set up")
        data += chunk
    try:
        return int(json.loads(data.split(b"\n", 1)[0])["child-pid"])
    except (ValueError, KeyError, TypeError):
        raise SandboxError(f"bwrap's status is not what it should be: {data[:200]!r}") from None


def wait_loopback(init_pid: int, *, timeout: float = STATUS_TIMEOUT_S, proc: str = "/proc") -> None:
    """Blocking, ~1 ms: wait until the sandbox whose init is `init_pid` (host pid) has its loopback
    up (127.0.0.1 in its network namespace's routes, /proc/<pid>/net/fib_trie). bwrap says its
    init's pid before the init sets up the loopback (bubblewrap.c: the parent writes the status,
    then the child runs loopback_setup), and slirp4netns --configure brings `lo` up too, which gives
    it 127.0.0.1 at once: attached earlier, bwrap's own RTM_NEWADDR then failed ("bwrap: loopback:
    Failed RTM_NEWADDR", the session's start with it; 2 of 8 runs under load). Returns at once
    where the routes cannot be read (the sandbox is gone: attaching then says why). Raises
    SandboxError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"{proc}/{init_pid}/net/fib_trie") as f:
                if "127.0.0.1" in f.read():
                    return
        except OSError:
            return
        if time.monotonic() >= deadline:
            raise SandboxError(f"the sandbox's loopback was not up within {timeout:g} s")
        time.sleep(SETUP_POLL_S)


def wait_set_up(init_pid: int, *, timeout: float = STATUS_TIMEOUT_S, proc: str = "/proc") -> None:
    """Blocking: wait until the sandbox whose init is `init_pid` (host pid) is set up: bwrap says
    its init's pid before the init has mapped its user and moved into its new root, and the init
    forks the session's command only once all is done (bubblewrap.c: the fork for pid 1 follows
    the set-up), so until it has a child an exec entering its namespaces could find the node's
    file system there. An init that ended is done too (the command ran, or bwrap failed: it says
    so on the terminal). Raises SandboxError after `timeout` seconds (a few ms in practice)."""
    children = f"{proc}/{init_pid}/task/{init_pid}/children"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(children) as f:
                if f.read().strip():
                    return
            with open(f"{proc}/{init_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except (OSError, IndexError):  # gone
            return
        if time.monotonic() >= deadline:
            raise SandboxError(f"the sandbox was not set up within {timeout:g} s")
        time.sleep(SETUP_POLL_S)


def probe(setting: str, *, uid: int, gid: int, network: str, block_private: bool = True) -> tuple[Sandbox | None, str]:
    """Blocking, once when the agent starts: the sandbox of agent.toml's `[container] sandbox`
    (`setting`), `uid`/`gid` and `network` ("host" shares the node's; "outbound": slirp4netns
    and nft, where the agent is root and both are installed, else loopback only, logged as a
    warning with the reason; `block_private`: outbound refuses private addresses too), checked
    by running a command through it exactly as a session would run. Returns (Sandbox, "") or
    (None, why no sandbox is possible here: a tool missing, user namespaces off, …; for "none":
    that the operator said so)."""
    if setting == SANDBOX_NONE:
        return None, 'agent.toml says [container] sandbox = "none"'
    tools = {name: shutil.which(name) for name in ("bwrap", "setpriv", "unshare", "nsenter")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        return None, f"{', '.join(missing)} not found on PATH (Debian: apt-get install bubblewrap util-linux)"
    drop = os.geteuid() == 0
    if drop:
        try:
            STAGE_POINT.mkdir(mode=0o755, exist_ok=True)
        except OSError as exc:
            return None, f"cannot create {STAGE_POINT}: {exc.strerror or exc}"
    sandbox = Sandbox(
        bwrap=str(tools["bwrap"]),
        setpriv=str(tools["setpriv"]),
        unshare=str(tools["unshare"]),
        nsenter=str(tools["nsenter"]),
        uid=uid if drop else os.getuid(),
        gid=gid if drop else os.getgid(),
        drop=drop,
        share_net=network == NETWORK_HOST,
        read_only=python_directories(),
        block_private=block_private,
    )
    if network == NETWORK_OUTBOUND:
        slirp4netns, nft, why = outbound_tools(drop=drop)
        if why:
            log.warning('agent.toml says [container] network = "outbound", but sessions get only their own loopback: %s', why)
        sandbox = dataclasses.replace(sandbox, slirp4netns=slirp4netns, nft=nft)
    with tempfile.TemporaryDirectory(prefix="fgpu-sandbox-probe-") as home:
        sandbox.own(Path(home))
        why = _trial(sandbox, Path(home))
    return (None, why) if why else (sandbox, "")


def outbound_tools(*, drop: bool) -> tuple[str, str, str]:
    """(slirp4netns's path, nft's path, "") where sessions can have the outbound network: the
    agent is root (`drop`: it enters each session's network namespace as root to install its
    rules) and both tools are installed; else ("", "", why not)."""
    if not drop:
        return "", "", "the agent is not root, so it cannot install a session's network rules"
    found = {name: shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), "")
             for name in ("slirp4netns", "nft")}  # fmt: skip
    missing = [name for name, path in found.items() if not path]
    if missing:
        return "", "", f"{', '.join(missing)} not found (Debian: apt-get install slirp4netns nftables)"
    return found["slirp4netns"], found["nft"], ""


def _trial(sandbox: Sandbox, home: Path) -> str:
    """Blocking: run a trial command through `sandbox` with `home`: that the agent's Python can
    be run inside. Returns "" or why it failed."""
    read, write = os.pipe()
    trial = ["/bin/sh", "-c", 'test -x "$1" || exit 3', "fgpu-probe", sys.executable]
    try:
        argv = sandbox.command(trial, home=home, data=[], status_fd=write)
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(write,)
        )
        os.close(write)
        write = -1
        try:
            out, _ = child.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return f"bwrap did not finish a trial command within {PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"bwrap could not be started: {exc}"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    if child.returncode == 3:
        return f"the agent's Python ({sys.executable}) cannot be run inside the sandbox"
    if child.returncode:
        said = out.decode(errors="replace").strip() or f"exit status {child.returncode}"
        return f"bwrap cannot create a sandbox here: {said}"
    return ""


def python_directories() -> tuple[str, ...]:
    """What the agent's Python needs inside a sandbox, read-only: its installation
    (`sys.base_prefix`, `sys.prefix`: the venv, and where `sys.executable` leads) and the
    project's `agent` package (the virtual nvidia-smi imports agent.nvidia_smi from it). None
    lies inside another (bwrap binds each at its own path)."""
    executable = Path(sys.executable).resolve()
    candidates = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), executable.parent.parent]
    candidates.append(Path(__file__).resolve().parent)  # the agent package
    kept: list[Path] = []
    for path in sorted(set(candidates), key=lambda p: len(p.parts)):
        if path == Path("/") or any(path == k or k in path.parents for k in kept):
            continue
        if any(str(path).startswith(prefix + "/") or str(path) == prefix for prefix in ("/usr", "/etc")):
            continue  # the system's: bound anyway
        kept.append(path)
    return tuple(str(p) for p in kept)


# --- reaping what a sandbox leaves -------------------------------------------------------
#
# bwrap (the leader) exits as soon as its sandbox's init says that the session's command ended,
# without waiting for that init, which exits a moment later; and util-linux nsenter (an exec) may
# end before the child it forked into the sandbox. Both orphans are reparented by the kernel to the
# nearest "child subreaper" above them, else to the node's pid 1, which on a machine whose pid 1
# reaps nothing (a container's, some VMs') keeps them as zombies for good: one per ended session,
# and an init whose namespace still holds an unreaped zombie never finishes exiting (it waits in
# the kernel for every process of its namespace to be reaped). So the agent declares itself their
# subreaper (`become_subreaper`) and reaps them when a session is removed (`reap_orphans`).

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (prctl(2)
    PR_SET_CHILD_SUBREAPER): an orphan among them comes to it rather than to the node's pid 1.
    Returns whether the kernel took it (it logs why not)."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("could not become the subreaper of sessions' processes: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def reap_orphans(*, proc: str = "/proc") -> int:
    """Blocking, a few reads of `proc`: reap every zombie child of this process that lives in a PID
    namespace below its own (a sandbox's init, an exec's child whose nsenter ended first: orphans
    the kernel handed to this process as their subreaper). Its own children (subprocess.Popen's,
    which reap them) live in its own namespace and are never touched. Returns how many were reaped."""
    depth = _namespace_depth(f"{proc}/self/status")
    reaped = 0
    for children in Path(proc, "self", "task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for pid in pids:
            status = f"{proc}/{pid}/status"
            try:
                with open(status) as f:
                    zombie = any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
            except OSError:
                continue
            if not zombie or _namespace_depth(status) <= depth:
                continue
            try:  # a zombie child of ours stays ours (and its pid unused) until we reap it
                if os.waitpid(int(pid), os.WNOHANG)[0]:
                    reaped += 1
            except ChildProcessError:
                continue
    return reaped


def _namespace_depth(status: str) -> int:
    """How many PID namespaces the process of `status` (a /proc/<pid>/status) has a pid in (its
    NSpid line's entries); 0 if it is gone."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) - 1
    except OSError:
        pass
    return 0


# --- reaching a port inside a session's own network namespace ---------------------------


_netns_lock = threading.Lock()


def netns_socket(pid: int, family: int = socket.AF_INET) -> socket.socket:
    """Blocking: a new TCP socket that belongs to the network namespace of process `pid` (a
    sandbox's init): the calling thread enters that namespace (setns(2) on /proc/<pid>/ns/net),
    creates the socket and returns to its own before anything else runs on it. Connect it as
    any other (the namespace is the socket's for its life). Raises OSError (the process is gone;
    EPERM: the agent may not enter it)."""
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _netns_lock:
            own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(target, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns into the network namespace of {pid}: {os.strerror(code)}")
                try:
                    return socket.socket(family, socket.SOCK_STREAM)
                finally:
                    if _libc.setns(own, CLONE_NEWNET) != 0:  # never leave this thread in the session's namespace
                        code = ctypes.get_errno()
                        log.critical("could not return to the agent's network namespace: %s", os.strerror(code))
                        os._exit(70)
            finally:
                os.close(own)
    finally:
        os.close(target)
