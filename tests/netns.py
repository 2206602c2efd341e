"""Two hosts on one machine: two network namespaces joined by a veth pair.

Each namespace has its own loopback, its own address on a private subnet and its own
routing table, so processes in "host A" and "host B" talk only over the veth link, as
two machines would over a network. Taking host B's end of the link down cuts the network.

    with make_two_hosts() as hosts:
        subprocess.run(hosts.a.cmd("python", "train.py", ...))   # runs "on host A"
        hosts.link_down()                                        # cut B off

Needs root and iproute2 (`ip netns`, veth). Names carry this process's pid, so parallel
runs cannot clash; namespaces left by a run that crashed (its pid is gone) are removed at
the next start. The hosts share the UTS namespace, hence the hostname, and /etc/hosts maps
that name to 127.0.0.1: as on a Debian host whose hostname resolves to 127.0.1.1, gloo
would bind to loopback unless told the interface (GLOO_SOCKET_IFNAME, see `Host.env`).
"""

import functools
import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

PREFIX = "gpttest"
SUBNET = "10.213.7"


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    name: str    # the network namespace
    addr: str    # this host's address on the veth link
    ifname: str  # this host's end of the veth pair

    def cmd(self, *argv) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def env(self, base: dict) -> dict:
        """`base` plus the interface gloo (and NCCL) must bind to on this host."""
        return {**base, "GLOO_SOCKET_IFNAME": self.ifname, "NCCL_SOCKET_IFNAME": self.ifname}

    def pids(self) -> list[int]:
        proc = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in proc.stdout.split()]

    def kill_all(self):
        """SIGKILL every process still in this namespace (strays of a failed test)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class TwoHosts:
    a: Host
    b: Host

    def link_down(self):
        """Cut the network: host B's end of the link goes down (A sees no carrier either)."""
        _ip("-n", self.b.name, "link", "set", self.b.ifname, "down")

    def link_up(self):
        _ip("-n", self.b.name, "link", "set", self.b.ifname, "up")

    def remove(self):
        for host in (self.a, self.b):
            host.kill_all()
        for host in (self.a, self.b):  # deleting a namespace destroys its veth end and the peer
            _ip("netns", "delete", host.name, check=False)
            _ip("link", "delete", host.ifname, check=False)  # in case it never left the root


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers():
    """Remove namespaces and links of earlier runs whose process is gone (a crashed run)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if parts[0] == PREFIX and parts[-1].isdigit() and not _pid_alive(int(parts[-1])):
            Host(name, "", "").kill_all()
            _ip("netns", "delete", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if link[:3] in ("gta", "gtb") and link[3:].isdigit() and not _pid_alive(int(link[3:])):
            _ip("link", "delete", link, check=False)


@functools.lru_cache(maxsize=None)
def skip_reason() -> str:
    """Why two hosts cannot be made here, or '' when they can (tries a namespace once)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces"
    remove_leftovers()
    probe = f"{PREFIX}-probe-{os.getpid()}"
    proc = _ip("netns", "add", probe, check=False)
    _ip("netns", "delete", probe, check=False)
    if proc.returncode:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    return ""


@contextmanager
def make_two_hosts():
    """Namespaces '{PREFIX}-a-PID' (10.213.7.1) and '{PREFIX}-b-PID' (10.213.7.2), veth-linked."""
    pid = os.getpid()
    hosts = TwoHosts(Host(f"{PREFIX}-a-{pid}", f"{SUBNET}.1", f"gta{pid}"),
                     Host(f"{PREFIX}-b-{pid}", f"{SUBNET}.2", f"gtb{pid}"))
    remove_leftovers()
    hosts.remove()  # a previous test of this very process that could not clean up
    try:
        try:
            for host in (hosts.a, hosts.b):
                _ip("netns", "add", host.name)
            _ip("link", "add", hosts.a.ifname, "type", "veth", "peer", "name", hosts.b.ifname)
            for host in (hosts.a, hosts.b):
                _ip("link", "set", host.ifname, "netns", host.name)
                _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
                _ip("-n", host.name, "link", "set", "lo", "up")
                _ip("-n", host.name, "link", "set", host.ifname, "up")
        except RuntimeError as e:
            pytest.skip(f"cannot create two network namespaces here: {e}")
        yield hosts
    finally:
        hosts.remove()


@pytest.fixture(scope="module")
def multihost_possible():
    """Skip a whole module (before its costly module fixtures) where namespaces cannot be made."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def two_hosts():
    """Host A and host B, removed after the test (pass or fail); skips without root."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with make_two_hosts() as hosts:
        yield hosts
