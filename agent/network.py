"""Sessions' network on a docker node (agent.toml `[container] network`): isolated from each other,
from the node itself and from link-local and (by default) private addresses.

`outbound` (the default; `bridge` is its old name): each agent has a Docker network of its own,
`fgpu-<node>-<instance>` (driver bridge, inter-container traffic off:
`com.docker.network.bridge.enable_icc=false`; its Linux bridge `fgpu-<instance>`, 15 characters),
created when missing. Docker masquerades what leaves it, so sessions reach the internet. The
agent adds what Docker does not do, in an iptables chain of its own, `FGPU-<instance>`, jumped to
from INPUT and DOCKER-USER for packets that come in on that bridge only:

1. replies (conntrack ESTABLISHED,RELATED) pass: the web and the agent's app relay on this host
   open connections to a container's app port, and the container's answers come back;
2. DNS (port 53, UDP and TCP) to the host's nameservers (/etc/resolv.conf) passes, whatever their
   address: Docker's embedded resolver forwards a container's queries from inside its namespace;
3. dropped: anything to the host's own addresses (`addrtype LOCAL`: every interface, the bridge's
   gateway, a service listening on 0.0.0.0: Redis, PostgreSQL, the web, the agent), to
   169.254.0.0/16 (cloud metadata), to the network's own subnet (another session; Docker's icc
   rule drops it too) and, unless `block-private-networks = false`, to 10.0.0.0/8, 172.16.0.0/12,
   192.168.0.0/16 and 100.64.0.0/10 (the control plane on other hosts, the site's network).

The chain is rebuilt at every agent start (flushed, its rules appended again, its jumps removed
and inserted first again); rules of other chains are never touched. `iptables` is the command
that holds Docker's DOCKER-USER chain (iptables-nft or iptables-legacy, `-S DOCKER-USER`). The
chain is removed with the network when the agent ends and no container is left on it.

`none`: no network at all (only `lo`); session apps cannot be reached.

A process-runtime session's `outbound` network (slirp4netns and nftables rules inside its own
network namespace, the same destinations refused) is the second part of this module.

The instance id is a hash of the agent's scratch root, so two consoles on one host (two `make run`
checkouts, the tests) have networks and chains of their own, and an agent that starts again
finds its own.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OUTBOUND, NONE = "outbound", "none"
NETWORKS = (OUTBOUND, NONE)
OLD_NAMES = {"bridge": OUTBOUND}  # agent.toml's network before issue 31
LINK_LOCAL = "169.254.0.0/16"
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")  # RFC 1918, RFC 6598
LABEL_NODE, LABEL_INSTANCE = "fgpu.node", "fgpu.instance"
IPTABLES_CANDIDATES = ("iptables", "iptables-nft", "iptables-legacy")
IPTABLES_TIMEOUT_S = 10


class NetworkError(RuntimeError):
    """The session network or its rules could not be made; the message says what, in Docker's or
    iptables' words."""


@dataclass(frozen=True)
class NetworkNames:
    """The names of an agent's session network: Docker's network, its Linux bridge (at most 15
    characters, the kernel's IFNAMSIZ) and the iptables chain (at most 28)."""

    network: str
    bridge: str
    chain: str
    instance: str


def network_mode(network: str) -> str:
    """agent.toml's network value in its current name ("bridge" → "outbound"). Raises ValueError
    for anything but outbound, none or bridge."""
    network = OLD_NAMES.get(network, network)
    if network not in NETWORKS:
        raise ValueError(f'{network!r}: expected "outbound" (or its old name "bridge") or "none"')
    return network


def instance_id(key: str) -> str:
    """10 hex digits naming an agent installation on its host: a hash of `key` (its scratch root's
    absolute path, agent.boot)."""
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def installation_id(scratch_root: Path | str) -> str:
    """`instance_id` of the agent installation whose scratch root is `scratch_root` (resolved
    first): the one id its docker network, containers and parent cgroups are named by."""
    return instance_id(os.fsdecode(Path(scratch_root).resolve()))


def network_names(node: str, instance: str) -> NetworkNames:
    """The names for node `node`'s agent with instance id `instance` (instance_id)."""
    return NetworkNames(network=f"fgpu-{node}-{instance}", bridge=f"fgpu-{instance}", chain=f"FGPU-{instance}", instance=instance)


def host_nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The IPv4 nameservers of `resolv_conf`, loopback ones left out (Docker's resolver reaches
    those from the host's namespace, not through the bridge)."""
    found = []
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                address = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            if address.version == 4 and not address.is_loopback and str(address) not in found:
                found.append(str(address))
    return found


def guard_rules(*, subnet: str, nameservers: list[str], block_private: bool) -> list[list[str]]:
    """The rules of the chain, in order, each as iptables arguments after `-A <chain>` (pure; see
    the module docstring). `subnet`: the network's IPv4 subnet ("172.18.0.0/16")."""
    rules = [["-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "RETURN"]]
    for server in nameservers:
        for protocol in ("udp", "tcp"):
            rules.append(["-d", server, "-p", protocol, "--dport", "53", "-j", "RETURN"])
    rules.append(["-m", "addrtype", "--dst-type", "LOCAL", "-j", "DROP"])
    rules.append(["-d", LINK_LOCAL, "-j", "DROP"])
    if subnet:
        rules.append(["-d", subnet, "-j", "DROP"])
    if block_private:
        rules.extend(["-d", block, "-j", "DROP"] for block in PRIVATE_RANGES)
    return rules


def iptables_command() -> tuple[str | None, str]:
    """`(command, "")`: the iptables that holds Docker's DOCKER-USER chain (where Docker puts its
    rules: nft or legacy); `(None, why)` where none does (no iptables, not root, Docker without
    iptables)."""
    problems = []
    for name in IPTABLES_CANDIDATES:
        path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if Path(p).exists()), None)
        if path is None:
            continue
        done = _run([path, "-w", "5", "-S", "DOCKER-USER"], check=False)
        if done.returncode == 0:
            return path, ""
        problems.append(f"{name}: {done.stderr.strip() or done.returncode}")
    if not problems:
        return None, "no iptables command on this machine"
    return None, "; ".join(problems)


def guard_install(
    names: NetworkNames, *, subnet: str, block_private: bool, iptables: str, nameservers: list[str] | None = None
) -> None:
    """Blocking: make chain `names.chain` hold guard_rules and be the first jump of INPUT and
    DOCKER-USER for packets in on `names.bridge`, replacing what an earlier start left (idempotent).
    Raises NetworkError with iptables' words."""
    servers = host_nameservers() if nameservers is None else nameservers
    ipt = [iptables, "-w", "5"]
    if _run([*ipt, "-S", names.chain], check=False).returncode != 0:
        _run([*ipt, "-N", names.chain])
    _run([*ipt, "-F", names.chain])
    for rule in guard_rules(subnet=subnet, nameservers=servers, block_private=block_private):
        _run([*ipt, "-A", names.chain, *rule])
    for parent in ("INPUT", "DOCKER-USER"):
        _delete_jumps(ipt, parent, names)
        _run([*ipt, "-I", parent, "1", "-i", names.bridge, "-j", names.chain])


def guard_remove(names: NetworkNames, *, iptables: str) -> None:
    """Blocking: remove the jumps to `names.chain` and the chain itself; what is not there is fine."""
    ipt = [iptables, "-w", "5"]
    for parent in ("INPUT", "DOCKER-USER"):
        _delete_jumps(ipt, parent, names)
    if _run([*ipt, "-S", names.chain], check=False).returncode == 0:
        _run([*ipt, "-F", names.chain], check=False)
        _run([*ipt, "-X", names.chain], check=False)


def _delete_jumps(ipt: list[str], parent: str, names: NetworkNames) -> None:
    for _ in range(100):  # every copy an earlier start may have left
        if _run([*ipt, "-D", parent, "-i", names.bridge, "-j", names.chain], check=False).returncode != 0:
            return


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IPTABLES_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise NetworkError(f"{' '.join(argv)}: {exc}") from None
        return subprocess.CompletedProcess(argv, 1, "", str(exc))
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done


class SessionNetwork:
    """An agent's session network (the module docstring) through `client` (a docker.DockerClient).
    `ensure()` at agent start; `guarded`: whether its iptables chain is in place; `warning`: why
    not, in words for the operator ("" when guarded)."""

    def __init__(self, client, *, node: str, instance: str, block_private: bool = True):
        self.client = client
        self.node = node
        self.names = network_names(node, instance)
        self.block_private = block_private
        self.guarded = False
        self.warning = ""
        self.iptables: str | None = None

    def ensure(self) -> None:
        """Blocking: the Docker network exists (created if missing), then its chain is (re)built.
        Raises NetworkError when Docker refuses the network. Where iptables cannot be used, the
        network still keeps sessions from each other (Docker's icc rule), `guarded` is False and
        `warning` says why, and the agent logs it as a warning."""
        network = self._network()
        pools = (network.attrs.get("IPAM") or {}).get("Config") or []
        subnet = next((pool["Subnet"] for pool in pools if ":" not in pool.get("Subnet", ":")), "")  # its IPv4 subnet
        self.iptables, problem = iptables_command()
        try:
            if self.iptables is None:
                raise NetworkError(problem)
            guard_install(self.names, subnet=subnet, block_private=self.block_private, iptables=self.iptables)
        except NetworkError as exc:
            self.guarded = False
            self.warning = (
                f"sessions on node {self.node} are NOT kept from this host's addresses, link-local or private "
                f"networks: the iptables rules of network {self.names.network} could not be installed ({exc}). "
                'Run the agent as root with iptables, or set agent.toml [container] network = "none".'
            )
            log.warning("%s", self.warning)
            return
        self.guarded, self.warning = True, ""
        log.info(
            "agent %s: sessions' network %s (bridge %s, %s): no session-to-session, host, link-local%s traffic",
            self.node,
            self.names.network,
            self.names.bridge,
            subnet,
            ", private" if self.block_private else "",
        )

    def _network(self):
        import docker

        try:
            return self.client.networks.get(self.names.network)
        except docker.errors.NotFound:
            pass
        try:
            return self.client.networks.create(
                self.names.network,
                driver="bridge",
                options={
                    "com.docker.network.bridge.enable_icc": "false",
                    "com.docker.network.bridge.name": self.names.bridge,
                    "com.docker.network.bridge.enable_ip_masquerade": "true",
                },
                labels={LABEL_NODE: self.node, LABEL_INSTANCE: self.names.instance},
                check_duplicate=True,
            )
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # another start made it meanwhile
                return self.client.networks.get(self.names.network)
            raise NetworkError(f"Docker refused network {self.names.network}: {exc.explanation or exc}") from None

    def remove(self) -> bool:
        """Blocking: remove the network and its chain unless a container is still on it. Returns
        whether they are gone."""
        import docker

        try:
            network = self.client.networks.get(self.names.network)
            network.reload()
            if network.attrs.get("Containers"):
                return False
            network.remove()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            log.warning("agent %s: could not remove network %s: %s", self.node, self.names.network, exc.explanation or exc)
            return False
        iptables = self.iptables or iptables_command()[0]
        if iptables is not None:
            guard_remove(self.names, iptables=iptables)
        return True


# --- a process-runtime session's outbound network (agent.toml `[container] network = "outbound"`) ---
#
# The process runtime's sandbox has a network namespace of its own (agent.sandbox). With
# `outbound`, slirp4netns (Debian's; a user-mode TCP/IP stack, the one rootless Podman and Docker
# use) gives it a tap device, 10.0.2.100/24, a gateway 10.0.2.2 and a DNS forwarder 10.0.2.3, and
# makes the session's connections from the node's network on its behalf, with
# `--disable-host-loopback` (10.0.2.2 does not lead to the node's 127.0.0.1). What slirp4netns
# does not refuse (the node's other addresses, where Redis, PostgreSQL or the web may listen on
# 0.0.0.0; 169.254/16; the site's private networks) is refused by nftables rules inside the
# session's own namespace (`session_ruleset`), installed by the agent before the session's command
# runs (bwrap waits on `--block-fd` meanwhile); the session holds no capability there, so it can
# neither read nor change them. The same destinations as a docker session's `FGPU-<instance>` chain.

SLIRP_GATEWAY = "10.0.2.2"  # slirp4netns's default network 10.0.2.0/24: the node, as the session sees it
SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder (to the node's resolvers)
SLIRP_SUBNET = "10.0.2.0/24"
SLIRP_TAP = "tap0"
SLIRP_MTU = 65520  # slirp4netns' own recommendation (its man page): fewer, larger frames through the user-mode stack
SESSION_TABLE = "fgpu_session"


def host_addresses(fib_trie: Path = Path("/proc/net/fib_trie")) -> list[str]:
    """Blocking, one read: the IPv4 addresses of this node's own interfaces (the kernel's LOCAL
    routes in `fib_trie`, this process's network namespace), loopback ones left out; [] where it
    cannot be read."""
    found: list[str] = []
    try:
        lines = fib_trie.read_text().splitlines()
    except OSError:
        return []
    last = ""
    for line in lines:
        text = line.strip()
        if text.startswith(("|--", "+--")):
            last = text.split()[1]
        elif text.endswith("host LOCAL") and last:
            try:
                address = ipaddress.ip_address(last)
            except ValueError:
                continue
            if not address.is_loopback and last not in found:
                found.append(last)
    return found


def session_ruleset(*, host: list[str], nameservers: list[str], block_private: bool) -> str:
    """The nftables ruleset (`nft -f` text) of an outbound process-runtime session's network
    namespace (pure): what leaves on any interface but `lo` is refused (a TCP reset or ICMP
    unreachable: the caller sees "Connection refused" at once) when it goes to the node (`host`:
    its addresses, host_addresses; slirp4netns's gateway), to 127/8, 169.254/16, slirp's subnet
    but its DNS forwarder, and, with `block_private`, to 10/8, 172.16/12, 192.168/16, 100.64/10;
    all IPv6 is refused (slirp4netns runs without it). DNS (port 53) to slirp's forwarder and to
    the node's `nameservers` passes first, as in `guard_rules`. Raises ValueError for an address
    that is not IPv4."""
    for address in [*host, *nameservers]:
        ipaddress.IPv4Address(address)
    dns = ", ".join(dict.fromkeys([SLIRP_DNS, *nameservers]))
    refused = [SLIRP_GATEWAY, *host, "127.0.0.0/8", LINK_LOCAL, SLIRP_SUBNET]
    if block_private:
        refused.extend(PRIVATE_RANGES)
    return "\n".join([
        f"table inet {SESSION_TABLE} {{",
        "  chain output {",
        "    type filter hook output priority 0; policy accept;",
        '    oifname "lo" accept',
        "    meta nfproto ipv6 reject",
        f"    ip daddr {{ {dns} }} udp dport 53 accept",
        f"    ip daddr {{ {dns} }} tcp dport 53 accept",
        *(f"    ip daddr {block} reject" for block in refused),  # one rule each: nft refuses overlapping set elements
        "  }",
        "}",
        "",
    ])  # fmt: skip
