"""Linux network namespaces as "hosts" for tests: a namespace joined to this one by a veth pair, with its own
address, created for a test and always deleted after it.

    with Host("aiollm-b") as host:     # needs root (CAP_NET_ADMIN); `available()` says whether it can run
        node = await graph.start_node("decode", process=True, prefix=host.exec, listen=f"tcp://{host.ip}:0")
        host.link(up=False)            # cut the link; host.netem("delay 100ms loss 10%") degrades it

The addresses are in a private /30 used only between the two ends, so no traffic leaves the machine.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

# the /30 subnets handed out: 10.77.<n>.0/30 (this side .1, the namespace .2)
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


class Host:
    """A network namespace `name` reached over a veth pair: this side `gateway`, the namespace `ip`."""

    def __init__(self, name: str) -> None:
        n = next(_subnets) % 250
        self.name = name
        self.gateway, self.ip = f"10.77.{n}.1", f"10.77.{n}.2"
        self.outer, self.inner = f"vo{os.getpid() % 10000}{n}", f"vi{os.getpid() % 10000}{n}"
        # the command prefix that runs a process inside the namespace
        self.exec = ("ip", "netns", "exec", name)

    def __enter__(self) -> Host:
        try:
            _run("ip", "netns", "add", self.name)
            _run("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _run("ip", "link", "set", self.inner, "netns", self.name)
            _run("ip", "addr", "add", f"{self.gateway}/30", "dev", self.outer)
            _run("ip", "link", "set", self.outer, "up")
            _run(*self.exec, "ip", "addr", "add", f"{self.ip}/30", "dev", self.inner)
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
        """Bring the link between the namespaces up or down (from this side)."""
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
        """Degrade this side of the link with `tc netem` (e.g. "delay 100ms loss 10%"); None removes it."""
        if spec is None:
            subprocess.run(["tc", "qdisc", "del", "dev", self.outer, "root"], capture_output=True)
        else:
            _run("tc", "qdisc", "replace", "dev", self.outer, "root", "netem", *spec.split())
