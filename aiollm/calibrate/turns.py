"""S-workers taking turns on one core, so that runs of two configurations are measured side by side.

On a shared 2-vCPU host the memory bandwidth can drift by a quarter over minutes, more than the load-stabilising
schedule's whole predicted gain. Two runs one after the other therefore compare two phases of the host as much as
two configurations. Here both S-workers live at once, each with its own R-worker, and
take turns of a few seconds: every configuration samples the same minutes. Each worker's steps are then read on its
own clock, the wall clock with the other workers' turns cut out (`active_clock`).
"""

import asyncio
import itertools
import time
from collections.abc import Sequence

from aiollm.serving.fastdecode.s_worker import SWorker


class Turns:
    """Turns of `(name, iterations)`: `lead` first (a ramp-up, say), then `cycle` over and over. The named S-worker
    runs that many iterations of its loop (an iteration is its admissions, their prefill and one decode step), then
    hands over to the next turn; a worker waits while another holds the turn."""

    def __init__(self, cycle: Sequence[tuple[str, int]], lead: tuple[str, int] | None = None) -> None:
        first = [lead] if lead is not None else []
        if not cycle or any(n < 1 for _, n in first + list(cycle)):
            raise ValueError(f"cycle: expected turns of at least 1 iteration, got lead {lead}, cycle {list(cycle)}")
        self._turns = itertools.chain(first, itertools.cycle(list(cycle)))
        self.current, self._left = next(self._turns)
        self._changed = asyncio.Condition()
        self._running: str | None = None
        self._gone: set[str] = set()
        # workers inside `wait`: their loop is between iterations, so nothing of theirs (an admission streaming a
        # prompt's KV, a step) is under way
        self._at_turn: set[str] = set()
        # perf_counter at the start of each of a worker's stretches of turns
        self.starts: dict[str, list[float]] = {name: [] for name, _ in first + list(cycle)}
        self._cycle_names = {name for name, _ in cycle}

    async def wait(self, name: str) -> None:
        """Return when `name` may run one iteration."""
        if name not in self.starts:
            raise ValueError(f"name: {name!r} has no turn (the turns are {sorted(self.starts)}'s)")
        async with self._changed:
            self._at_turn.add(name)
            self._changed.notify_all()
            try:
                if self.current == name and self._left == 0:
                    self._advance()
                await self._changed.wait_for(lambda: self.current == name)
            finally:
                self._at_turn.discard(name)
            if self._running != name:  # a worker's consecutive turns are one stretch of its clock
                self.starts[name].append(time.perf_counter())
                self._running = name
            self._left -= 1

    async def leave(self, name: str) -> None:
        """`name` takes no more turns: a worker with nothing left to do would otherwise hold its turns idle (an
        idle S-worker waits for requests inside an iteration, so it never comes back to hand its turn over). Its
        `wait` never returns again."""
        async with self._changed:
            self._gone.add(name)
            if self.current == name:
                self._advance()
            self._changed.notify_all()

    async def parked(self, name: str) -> None:
        """Return once `name`, having left, waits at the top of its loop (see `leave`): stopping it then cuts off
        no admission half-way (stopped inside one, its R-worker's `Admit` failed on the vanished KV source)."""
        if name not in self._gone:
            raise ValueError(f"name: {name!r} has not left (parked waits for a worker that left)")
        async with self._changed:
            await self._changed.wait_for(lambda: name in self._at_turn)

    def _advance(self) -> None:
        """To the next turn of a worker still taking turns (None once all have left); the lock is held."""
        if self._cycle_names <= self._gone:
            self.current, self._left = None, 0
        else:
            self.current, self._left = next(self._turns)
            while self.current in self._gone:
                self.current, self._left = next(self._turns)
        self._changed.notify_all()


class TakingTurns(SWorker):
    """An S-worker that runs only in its turns of `turns`."""

    def __init__(self, *args, turns: Turns, turn_name: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.turns, self.turn_name = turns, turn_name

    async def _turn(self) -> None:
        await self.turns.wait(self.turn_name)


def active_clock(ended: Sequence[float], starts: Sequence[float]) -> list[float]:
    """Each step's end on its worker's own clock (seconds from the start of its first turn): a step's time is from
    the previous step's end, or from the start of its turn if that came later, to its own end."""
    if not starts:
        raise ValueError("starts: expected the start of at least one turn")
    clock, previous, turn, out = 0.0, starts[0], 0, []
    for end in ended:
        while turn + 1 < len(starts) and starts[turn + 1] <= end:
            turn += 1
        clock += end - max(previous, starts[turn])
        previous = end
        out.append(clock)
    return out
