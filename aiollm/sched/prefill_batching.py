"""Prefill batching up to the compute-bound length L_m (DistServe §3.1), as a pure function.

Why: prefill is compute-bound once a batch holds about L_m tokens; batching more only lengthens
every request's TTFT, batching fewer wastes the cores. So the prefill instance takes prompts from
the head of its FCFS queue while their total stays within L_m, and a prompt longer than L_m runs
alone. No reordering: a short prompt never jumps over a long one (FCFS keeps TTFT fair).
"""

from __future__ import annotations

from collections.abc import Sequence


def take_batch(queued_lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int = 0) -> int:
    """How many prompts to take from the head of the queue (lengths in queue order).

    `max_batch_tokens` is L_m; `max_batch_size` (0 = no limit) also caps the count. Returns 0 only
    for an empty queue: the head is always taken, alone if it exceeds L_m.
    """
    if max_batch_tokens <= 0:
        raise ValueError(f"max_batch_tokens (L_m) must be > 0, got {max_batch_tokens}")
    if max_batch_size < 0:
        raise ValueError(f"max_batch_size must be >= 0, got {max_batch_size}")
    total = 0
    taken = 0
    for length in queued_lengths:
        if length <= 0:
            raise ValueError(f"prompt lengths must be > 0, got {length}")
        if taken and (total + length > max_batch_tokens or taken == max_batch_size):
            break
        total += length
        taken += 1
        if total >= max_batch_tokens:
            break
    return taken
