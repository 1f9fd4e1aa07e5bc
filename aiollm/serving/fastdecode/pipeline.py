"""One FastDecode decode step on the S-worker: the S-part here, the R-part on the R-workers, per layer.

Why two mini-batches: without them the S-worker idles while the R-workers attend and the R-workers
idle while it computes. Splitting the batch in two and running both halves as concurrent
coroutines gives the overlap for free: while half A awaits its `Attend` replies for layer l, half B
computes its layer-l S-part on this thread, and the other way round. Each half's arithmetic is
the same as without the split (rows are independent), so the tokens are the same.

Within a half, rows are ordered by R-worker, so each R-worker's q/k/v are one contiguous slice of
one [rows, q + 2 kv heads, head_dim] tensor (the QKV projection's own output, no copy; one buffer per ask)
and each reply's attention output is received straight into its slice of the half's output tensor (`ask(into=)`: no
concatenation, no allocation per layer). Each half samples its rows as soon as its logits exist, while
the other half's last layers are still with the R-workers, and the logits are never gathered into one
[batch, vocab] tensor (at B=256 that gather alone copied 50 MB a step). The pure helpers (`place`,
`minibatches`) are tested on their own.

A lost R-worker (its process died, its node unreachable) fails the step with `RWorkerLost` naming it,
after the step's other work is cancelled, so the caller can re-place that worker's sequences and run
the same step again (the positions sent at layer 0 make the repeat overwrite, not append).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aiollm.actors.ref import ActorRef
from aiollm.errors import ActorDied, NodeUnreachable
from aiollm.model.llama import LlamaModel
from aiollm.serving.fastdecode.messages import Attend, Attended


class RWorkerLost(NodeUnreachable):
    """An R-worker stopped answering during a step (process died, node dropped); `worker` is its index."""

    def __init__(self, worker: int, url: str, cause: BaseException) -> None:
        super().__init__(f"R-worker {url} lost: {cause}")
        self.worker = worker


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


def minibatches(workers_of_rows: Sequence[int], pipeline: bool) -> list[list[int]]:
    """Row indices of each mini-batch, each sorted by R-worker: two with the pipeline (>= 2 rows), else one.

    Rows are dealt alternately after sorting by worker, so each half holds about half of every
    worker's rows and every R-worker has work in both halves (halving the sorted list instead would
    leave R-worker 0 idle while half B attends, and R-worker 1 while half A does)."""
    order = sorted(range(len(workers_of_rows)), key=lambda i: workers_of_rows[i])
    if not pipeline or len(order) < 2:
        return [order]
    return [order[0::2], order[1::2]]


# samples the rows `indices` (into the step's rows) from their fp32 logits [len(indices), vocab]: their tokens
Sampler = Callable[[list[int], torch.Tensor], list[int]]


async def decode_step(
    model: LlamaModel, workers: Sequence[ActorRef], rows: Sequence[StepRow], pipeline: bool, sample: Sampler
) -> list[int]:
    """One decode step over every row (rows in any worker order): the tokens `sample` chose, in row order."""
    groups = minibatches([r.worker for r in rows], pipeline)
    parts = await _all_or_cancel([_minibatch(model, workers, rows, g, n, sample) for n, g in enumerate(groups)])
    tokens = [0] * len(rows)
    for group, part in zip(groups, parts):
        for i, token in zip(group, part):
            tokens[i] = token
    return tokens


async def _minibatch(
    model: LlamaModel,
    workers: Sequence[ActorRef],
    all_rows: Sequence[StepRow],
    indices: list[int],
    group: int,
    sample: Sampler,
) -> list[int]:
    """Every layer of one mini-batch (`indices` sorted by worker): S-part here, attention on the R-workers; then
    its tokens."""
    rows = [all_rows[i] for i in indices]
    positions = [r.position for r in rows]
    seqs = np.array([r.seq for r in rows], dtype=np.int64)
    held = np.array(positions, dtype=np.int64)
    bounds = _worker_slices([r.worker for r in rows])
    c = model.config
    # the R-workers answer in bf16 when the queries are bf16, else fp32 (aiollm.serving.fastdecode.r_worker)
    out_dtype = torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32
    attn = torch.empty(len(rows), c.n_heads, c.head_dim, dtype=out_dtype)
    # each R-worker's reply lands in its rows of `attn`; reused by every layer (a layer's reply is asked for only
    # after the previous layer's output was consumed)
    outs = [attn[s] for _, s in bounds]
    into = [[out.view(torch.uint8).numpy()] for out in outs]
    ptrs = [out.data_ptr() for out in outs]
    # inference mode only around code without awaits (the other mini-batch runs in between): one block per layer,
    # layer l's post-attention and layer l+1's pre-attention together (entering it costs ~2 us a time)
    with torch.inference_mode():
        rope = model.rope(positions)
        h = model.embed([r.token for r in rows])
        qkv = _packed(*model.pre_attention(0, h, positions, rope))
    for layer in range(c.n_layers):
        replies = await _all_or_cancel(
            [
                _attend(
                    workers,
                    w,
                    Attend(group, layer, seqs[s] if layer == 0 else None, qkv[s], held[s] if layer == 0 else None),
                    into[i],
                )
                for i, (w, s) in enumerate(bounds)
            ]
        )
        with torch.inference_mode():
            for reply, out, ptr in zip(replies, outs, ptrs):
                if reply.o.data_ptr() != ptr:  # an R-worker in this process: its tensor as-is
                    out.copy_(reply.o)
            h = model.post_attention(layer, h, attn)
            if layer + 1 < c.n_layers:
                qkv = _packed(*model.pre_attention(layer + 1, h, positions, rope))
    with torch.inference_mode():
        return sample(indices, model.logits(h))


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v as one [rows, q + 2 kv heads, head_dim] tensor: a view when they are consecutive heads of one
    tensor already (LlamaModel.pre_attention's fused path returns views of its qkv projection), else a copy.

    The view saves a copy and an allocation per ask (a bare torch.cat of 32 bf16 rows of smollm2 takes ~6 us, more
    in a step's cold caches); the check takes ~3 us."""
    n, hq, d = q.shape
    hk = k.shape[1]
    step = q.element_size() * d
    packed = ((hq + 2 * hk) * d, d, 1)
    if (
        q.stride() == packed
        and k.stride() == packed
        and v.stride() == packed
        and q.dtype == k.dtype == v.dtype
        and k.data_ptr() == q.data_ptr() + hq * step
        and v.data_ptr() == k.data_ptr() + hk * step
    ):
        return q.as_strided((n, hq + 2 * hk, d), packed)
    return torch.cat((q, k, v), dim=1)


async def _attend(workers: Sequence[ActorRef], worker: int, msg: Attend, into: list) -> Attended:
    try:
        return await workers[worker].ask(msg, into=into)
    except (NodeUnreachable, ActorDied) as exc:
        raise RWorkerLost(worker, workers[worker].url, exc) from exc


async def _all_or_cancel(coros: list) -> list:
    """Results of all `coros` in order; on the first failure the others are cancelled (and awaited) before
    it is raised, so no half of a failed step keeps talking to the R-workers behind the caller's back."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _worker_slices(worker_of_row: list[int]) -> list[tuple[int, slice]]:
    """(worker, row slice) runs of a worker-sorted row list."""
    out: list[tuple[int, slice]] = []
    start = 0
    for i in range(1, len(worker_of_row) + 1):
        if i == len(worker_of_row) or worker_of_row[i] != worker_of_row[start]:
            out.append((worker_of_row[start], slice(start, i)))
            start = i
    return out
