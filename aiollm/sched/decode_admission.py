"""Continuous-batching admission for a decode instance, as pure bookkeeping over KV blocks.

Why reserve up front: a decode instance admits a sequence only when it can hold that sequence to
its end (prompt + max new tokens), so no running sequence is ever preempted or swapped, and the
KV pull for an admitted sequence always has somewhere to land (its credit window is exactly the
blocks reserved for the prompt). Waiting sequences stay FCFS: the head blocks those behind it,
so a long request cannot starve.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` KV entries."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Admission:
    """One admitted sequence: its id and the blocks reserved for it."""

    seq_id: str
    blocks: int


class DecodeAdmission:
    """FCFS waiting line and the block budget of one decode instance."""

    def __init__(self, total_blocks: int, block_size: int, max_running: int) -> None:
        for name, value in (("total_blocks", total_blocks), ("block_size", block_size), ("max_running", max_running)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.max_running = max_running
        self._waiting: OrderedDict[str, int] = OrderedDict()  # seq_id -> blocks it needs
        self._running: dict[str, int] = {}  # seq_id -> blocks reserved

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - sum(self._running.values())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def enqueue(self, seq_id: str, max_tokens_total: int) -> None:
        """Queue a sequence that may reach `max_tokens_total` KV entries; refuses one that can never fit."""
        need = blocks_for(max_tokens_total, self.block_size)
        if need > self.total_blocks:
            raise ValueError(f"sequence {seq_id!r} needs {need} blocks, the instance has {self.total_blocks}")
        if seq_id in self._waiting or seq_id in self._running:
            raise ValueError(f"sequence {seq_id!r} is already queued or running")
        self._waiting[seq_id] = need

    def admit(self) -> list[Admission]:
        """Admit waiting sequences from the head while blocks and batch slots allow."""
        admitted = []
        free = self.free_blocks
        while self._waiting and len(self._running) < self.max_running:
            seq_id, need = next(iter(self._waiting.items()))
            if need > free:
                break
            del self._waiting[seq_id]
            self._running[seq_id] = need
            free -= need
            admitted.append(Admission(seq_id, need))
        return admitted

    def release(self, seq_id: str) -> None:
        """Forget a sequence, waiting or running (finished, failed or cancelled)."""
        self._waiting.pop(seq_id, None)
        self._running.pop(seq_id, None)
