"""Where the machine's cores went during a serving run: the servers' process trees, this client, and
everything else (other users of a shared machine), from /proc.

Why: on a 2-core machine the disaggregated-vs-colocated comparison is decided by core time, so the
bench reports, beside each rate's latencies, how many cores the servers used and how many other
processes took; that is the measurement that says whether a missed target is the design or the box.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields after the command name (which may hold spaces)


def _tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_cpu_s(roots: list[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of these trees."""
    total = 0
    for root in roots:
        for pid in _tree(root):
            fields = _stat_fields(pid)
            if fields is not None:
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle (nor waiting for I/O) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / _TICK  # user..steal minus idle, iowait


@dataclass(frozen=True)
class CoreUse:
    """Average cores busy over one measured interval."""

    # the servers under test (every process of their trees) and this benchmark client
    ours: float
    # the whole machine
    machine: float
    cores: int

    @property
    def others(self) -> float:
        return max(0.0, self.machine - self.ours)


class CoreMeter:
    """Samples the servers' trees, this process and the machine; `stop()` gives the averages since `start()`."""

    def __init__(self, server_pids: list[int]) -> None:
        self.server_pids = server_pids

    def _sample(self) -> tuple[float, float]:
        mine = sum(os.times()[:2])
        return process_cpu_s(self.server_pids) + mine, machine_busy_s()

    def start(self, now: float) -> None:
        self._t0, (self._ours0, self._busy0) = now, self._sample()

    def stop(self, now: float) -> CoreUse:
        ours, busy = self._sample()
        wall = max(now - self._t0, 1e-9)
        return CoreUse((ours - self._ours0) / wall, (busy - self._busy0) / wall, os.cpu_count() or 1)
