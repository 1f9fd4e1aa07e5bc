"""Linux network namespaces as "hosts" for tests, created for a test and always deleted after it.

    with Host("aiollm-b") as host:          # one namespace joined to this one by a veth pair
        node = await graph.start_node("decode", process=True, prefix=host.exec, listen=f"tcp://{host.ip}:0")
        host.link(up=False)                 # cut the link; host.netem("delay 100ms loss 10%") degrades it

    with Lan("aiollm-l", 3) as lan:         # three namespaces on one bridge: every one reaches every other
        a, b, c = lan.hosts                 # and this namespace reaches all (lan.gateway is its address)

Needs root (CAP_NET_ADMIN); `available()` says whether it can run here. The addresses are private (10.77.n.0/30
for a Host, 10.78.n.0/24 for a Lan) and used only between these ends, so no traffic leaves the machine.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

# subnet numbers handed out in this process
_subnets = itertools.count(1)


def available() -> tuple[bool, str]:
    """(whether namespaces can be made here, and why not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "iproute2 (`ip`) is not installed"
    probe = f"aiollm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return True, ""


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _tag() -> str:
    """A short unique suffix for interface names (at most 15 characters in all)."""
    return f"{os.getpid() % 10000}{next(_subnets) % 1000}"


class Host:
    """A network namespace `name` with address `ip`, reached over a veth pair whose outer end is in this
    namespace (with `gateway`, for a point-to-point Host) or on a Lan's bridge."""

    def __init__(self, name: str, ip: str | None = None, prefix: int = 30, bridge: str = "") -> None:
        self.name = name
        if ip is None:
            n = next(_subnets) % 250
            self.gateway, self.ip = f"10.77.{n}.1", f"10.77.{n}.2"
        else:
            self.gateway, self.ip = "", ip
        self.prefix, self.bridge = prefix, bridge
        tag = _tag()
        self.outer, self.inner = f"vo{tag}", f"vi{tag}"
        # the command prefix that runs a process inside the namespace
        self.exec = ("ip", "netns", "exec", name)

    def __enter__(self) -> Host:
        try:
            _run("ip", "netns", "add", self.name)
            _run("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _run("ip", "link", "set", self.inner, "netns", self.name)
            if self.bridge:
                _run("ip", "link", "set", self.outer, "master", self.bridge)
            else:
                _run("ip", "addr", "add", f"{self.gateway}/{self.prefix}", "dev", self.outer)
            _run("ip", "link", "set", self.outer, "up")
            _run(*self.exec, "ip", "addr", "add", f"{self.ip}/{self.prefix}", "dev", self.inner)
            _run(*self.exec, "ip", "link", "set", self.inner, "up")
            _run(*self.exec, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        # deleting the namespace deletes its end of the pair, and with it this end
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.outer], capture_output=True)

    def link(self, up: bool) -> None:
        """Bring the host's link up or down (from this namespace's side)."""
        _run("ip", "link", "set", self.outer, "up" if up else "down")

    def netem_available(self) -> tuple[bool, str]:
        """(whether this kernel has the netem qdisc `netem` needs, and why not)."""
        probe = subprocess.run(
            ["tc", "qdisc", "replace", "dev", self.outer, "root", "netem", "delay", "1ms"],
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0:
            return False, f"tc netem is not available here: {probe.stderr.strip()}"
        self.netem(None)
        return True, ""

    def netem(self, spec: str | None) -> None:
        """Degrade the host's link with `tc netem` (e.g. "delay 100ms loss 10%"); None removes it."""
        if spec is None:
            subprocess.run(["tc", "qdisc", "del", "dev", self.outer, "root"], capture_output=True)
        else:
            _run("tc", "qdisc", "replace", "dev", self.outer, "root", "netem", *spec.split())


class Lan:
    """`n` namespaces (`hosts`, named `prefix-0`, `prefix-1`, ...) on one bridge; this namespace is on it too, at
    `gateway`, so a test process reaches every host and every host reaches every other."""

    def __init__(self, prefix: str, n: int) -> None:
        subnet = next(_subnets) % 250
        self.bridge = f"br{_tag()}"
        self.gateway = f"10.78.{subnet}.1"
        self.hosts = [
            Host(f"{prefix}-{i}", ip=f"10.78.{subnet}.{i + 2}", prefix=24, bridge=self.bridge) for i in range(n)
        ]

    def __enter__(self) -> Lan:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts:
                host.__enter__()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for host in self.hosts:
            host.__exit__()
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
