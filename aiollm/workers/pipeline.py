"""One FastDecode decode step on the S-worker: the S-part here, the R-part on the R-workers, per layer.

Why two mini-batches: without them the S-worker idles while the R-workers attend and the R-workers
idle while it computes. Splitting the batch in two and running both halves as concurrent
coroutines gives the overlap for free: while half A awaits its `Attend` replies for layer l, half B
computes its layer-l S-part on this thread, and the other way round. Each half's arithmetic is
the same as without the split (rows are independent), so the tokens are the same.

Within a half, rows are ordered by R-worker, so each R-worker's q/k/v are one contiguous slice
(no gather) and the outputs are concatenated back in the same order. The pure helpers
(`place`, `split`) are tested on their own.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aiollm.actors.ref import ActorRef
from aiollm.model.llama import LlamaModel
from aiollm.workers.fastdecode_messages import Attend


@dataclass
class StepRow:
    """What one step needs of a sequence: its id on its R-worker, that worker, its last token and position."""

    seq: int
    worker: int
    token: int
    position: int


def place(expected: Sequence[int], max_len: int, refused: frozenset[int] = frozenset()) -> int:
    """The R-worker for a new sequence: the one with the least expected total length (ties: lowest index).

    Expected total length (sum of prompt + max_tokens of the sequences placed there) is what the
    R-part of that worker will hold at the end of their lives, so balancing it balances the
    per-step attention work over the sequences' lifetime, not only now. `refused` are workers
    that just refused this sequence (budget full)."""
    candidates = [i for i in range(len(expected)) if i not in refused]
    if not candidates:
        raise ValueError("no R-worker left to place the sequence on")
    return min(candidates, key=lambda i: (expected[i] + max_len, i))


def split(n: int, pipeline: bool) -> list[slice]:
    """Row ranges of the mini-batches: two halves with the pipeline (when there are >= 2 rows), else one."""
    if not pipeline or n < 2:
        return [slice(0, n)]
    half = (n + 1) // 2
    return [slice(0, half), slice(half, n)]


async def decode_step(model: LlamaModel, workers: Sequence[ActorRef], rows: Sequence[StepRow],
                      pipeline: bool) -> torch.Tensor:
    """fp32 logits [len(rows), vocab] of one decode step over every row (rows in any worker order)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].worker)
    ordered = [rows[i] for i in order]
    parts = await asyncio.gather(*(_minibatch(model, workers, ordered[s], g)
                                   for g, s in enumerate(split(len(ordered), pipeline))))
    logits = torch.cat(parts) if len(parts) > 1 else parts[0]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return logits[inverse]


async def _minibatch(model: LlamaModel, workers: Sequence[ActorRef], rows: Sequence[StepRow],
                     group: int) -> torch.Tensor:
    """Every layer of one mini-batch (rows sorted by worker): S-part here, attention on the R-workers."""
    positions = [r.position for r in rows]
    seqs = np.array([r.seq for r in rows], dtype=np.int64)
    bounds = _worker_slices([r.worker for r in rows])
    # inference mode only around code without awaits: the other mini-batch runs in between
    with torch.inference_mode():
        rope = model.rope(positions)
        h = model.embed([r.token for r in rows])
    for layer in range(model.config.n_layers):
        with torch.inference_mode():
            q, k, v = model.pre_attention(layer, h, positions, rope)
        replies = await asyncio.gather(*(
            workers[w].ask(Attend(group, layer, seqs[s] if layer == 0 else None, q[s], k[s], v[s]))
            for w, s in bounds))
        with torch.inference_mode():
            attn = torch.cat([r.o for r in replies]) if len(replies) > 1 else replies[0].o
            h = model.post_attention(layer, h, attn)
    with torch.inference_mode():
        return model.logits(h)


def _worker_slices(worker_of_row: list[int]) -> list[tuple[int, slice]]:
    """(worker, row slice) runs of a worker-sorted row list."""
    out: list[tuple[int, slice]] = []
    start = 0
    for i in range(1, len(worker_of_row) + 1):
        if i == len(worker_of_row) or worker_of_row[i] != worker_of_row[start]:
            out.append((worker_of_row[start], slice(start, i)))
            start = i
    return out
