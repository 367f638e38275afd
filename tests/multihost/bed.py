"""The multi-host test bed's network (issue 37.1): a Linux bridge in the host's network namespace
and one network namespace per agent "host", joined to the bridge by a veth pair, each with an
address of its own on a /24 of the bridge; and what a real host's firewall and routes would do.

Names: the namespaces are `fgpu-mh-<pid>-<host>`; interface names are at most 15 characters,
so the bridge is `fgmh<pid>-br` and each host's end of its veth pair on the bridge `fgmh<pid>-<host>`
(inside a namespace it is `eth0`, which is that namespace's own). The subnet is 10.213.X.0/24, X
from the pid, moved on where the host already routes it. `HostsBed.down()` removes every one of
them and every iptables rule `up()` added, also after a failure halfway (each step on its own).

The bridge's address (.1) is the control plane's: the test's redis-server listens there, the web
and the manager reach it there, and the web reaches each agent at its host's address (.11, .12,
…): the agent's `app-address`, where its direct terminal streams and its app relays listen. A host
reaches another only at its address over the bridge (each namespace has its own loopback).

Session containers. An agent in a namespace still drives the machine's one Docker Engine (its unix
socket is a file, not an address), so its session containers live on the Docker network it makes
(`fgpu-<node>-<instance>`, agent.network) in the host's namespace, as that network's bridge and
its iptables rules do. The honest arrangement chosen: each agent host routes to its own Docker
network through the bridge (its default route is .1), and the host namespace forwards what comes in
on the bed's bridge from that agent's address to that network's bridge only (a rule in DOCKER-USER:
`-i fgmh<pid>-br -s <agent address> -o <its docker bridge> -j ACCEPT`; replies pass by the agent's
own chain, which accepts ESTABLISHED). That is what a real node is to its containers (they are on a
network of its own that it routes to), with the hop over the bridge added. The agent's own
`iptables` calls (its guard chain on DOCKER-USER and INPUT, agent.network) go to the namespace
that holds Docker's chains, the host's: a wrapper named `iptables` first on the agent's PATH runs
the real one under `nsenter --net=<the host's netns>`. And the host namespace itself, where the
web runs, may not open a connection to any agent's Docker network (`OUTPUT -o <its bridge>
--ctstate NEW -j REJECT`): the web reaches a session's app only through its node's agent.

Cutting a host's network (`cut`) sets its veth's end on the bridge down: the agent and its
containers go on, unreachable, as when a switch port or a cable fails; `restore` sets it up.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


@dataclass
class BedHost:
    """One agent host: its name (a letter), its network namespace, the veth end on the bridge, its address."""

    name: str
    netns: str
    veth: str
    address: str

    def command_prefix(self) -> tuple[str, ...]:
        """What runs a command in this host's network namespace (and nothing else of it changed)."""
        return ("nsenter", f"--net=/run/netns/{self.netns}", "--")


@dataclass
class HostsBed:
    """The bridge and the hosts `names` (short: "a", "b"); `up()` makes them, `down()` removes them."""

    names: list[str]
    work_dir: Path
    pid: int = field(default_factory=os.getpid)

    def __post_init__(self) -> None:
        self.tag = f"fgmh{self.pid}"
        self.bridge = f"{self.tag}-br"
        self.net = self._free_net()
        self.gateway = f"{self.net}.1"
        self.hosts = {name: BedHost(name, f"fgpu-mh-{self.pid}-{name}", f"{self.tag}-{name}", f"{self.net}.{11 + i}")
                      for i, name in enumerate(self.names)}
        self.rules: list[list[str]] = []  # iptables rules added: chain and match, as `-D` takes them
        self.iptables = shutil.which("iptables") or "/usr/sbin/iptables"

    def _free_net(self) -> str:
        routes = run(["ip", "-4", "route", "show"]).stdout
        for step in range(250):
            net = f"10.213.{(self.pid + step) % 250 + 1}"
            if f"{net}." not in routes:
                return net
        raise RuntimeError("no free 10.213.X.0/24 for the test bed")

    # --- making and removing -----------------------------------------------------------------

    def up(self) -> HostsBed:
        try:
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
            # The hosts reach each other, as on a switch: where br_netfilter has bridged frames pass
            # iptables' FORWARD, whose policy Docker sets to DROP, they are let through.
            self._rule(["DOCKER-USER", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"])
            for host in self.hosts.values():
                run(["ip", "netns", "add", host.netns])
                run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns])
                run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
                run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
                run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
                run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
                run(["ip", "-n", host.netns, "route", "add", "default", "via", self.gateway])
            bin_dir = self.work_dir / "host-bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            wrapper = bin_dir / "iptables"
            wrapper.write_text(f"#!/bin/sh\n# the node's firewall is the host namespace's, where Docker's chains are\n"
                               f"exec nsenter --net=/proc/{self.pid}/ns/net {self.iptables} \"$@\"\n")
            wrapper.chmod(0o755)
        except BaseException:
            self.down()
            raise
        return self

    def agent_env(self) -> dict:
        """What every agent's environment adds: the `iptables` wrapper first on PATH."""
        return {"PATH": f"{self.work_dir / 'host-bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    def route_to_containers(self, host: str, docker_bridge: str) -> None:
        """Let agent host `host` reach its Docker network (Linux bridge `docker_bridge`) through the
        host namespace, and keep the host namespace itself (the web) from opening connections to it."""
        address = self.hosts[host].address
        self._rule(["DOCKER-USER", "-i", self.bridge, "-s", address, "-o", docker_bridge, "-j", "ACCEPT"])
        self._rule(["OUTPUT", "-o", docker_bridge, "-m", "conntrack", "--ctstate", "NEW", "-j", "REJECT"])

    def _rule(self, rule: list[str]) -> None:
        run([self.iptables, "-w", "5", "-I", *rule])
        self.rules.append(rule)

    def down(self) -> None:
        """Remove the rules, namespaces, veths and bridge made (each step on its own: what is not there is passed by)."""
        for rule in reversed(self.rules):
            run([self.iptables, "-w", "5", "-D", *rule], check=False)
        self.rules.clear()
        for host in self.hosts.values():
            run(["ip", "link", "del", host.veth], check=False)
            run(["ip", "netns", "del", host.netns], check=False)
        run(["ip", "link", "del", self.bridge], check=False)

    def leftovers(self) -> list[str]:
        """What of the bed is still there (after `down`: nothing)."""
        found = [line for line in run(["ip", "-o", "link", "show"]).stdout.splitlines() if f" {self.tag}-" in line]
        found += [n for n in run(["ip", "netns", "list"]).stdout.split() if n.startswith(f"fgpu-mh-{self.pid}-")]
        found += [r for r in run([self.iptables, "-w", "5", "-S"]).stdout.splitlines() if self.bridge in r]
        return found

    # --- faults ------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Take host `host` off the network (its link down; its processes go on)."""
        run(["ip", "link", "set", self.hosts[host].veth, "down"])

    def restore(self, host: str) -> None:
        run(["ip", "link", "set", self.hosts[host].veth, "up"])

    def reaches(self, host: str, address: str, port: int) -> bool:
        """Whether a TCP connection from host `host`'s namespace to address:port opens (within 3 s)."""
        probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
                 "except OSError:\n sys.exit(1)\n")
        done = subprocess.run([*self.hosts[host].command_prefix(), "python3", "-c", probe, address, str(port)],
                              capture_output=True, timeout=30)
        return done.returncode == 0
