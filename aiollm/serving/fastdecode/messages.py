"""Wire types of FastDecode serving: S-worker <-> R-workers.

One decode step, per layer, is one `Attend` ask to every R-worker holding sequences of the batch
(or of one of the two mini-batches): the q/k/v rows of its sequences go out as one tensor, the
attention output `Attended.o` comes back. A sequence's id list travels only with layer 0 of a step (the step's
static part); the other layers name the mini-batch `group` and the R-worker reuses the block
tables it built at layer 0. Admission (`Admit`) makes the R-worker pull the prompt's KV itself
with the DistServe stream `PullKV` -> `KVBlock` items from whoever holds it (the S-worker under
FastDecode, a prefill instance under DistServe) and acknowledge with `AckKV`; those three
types live in aiollm.serving.distserve.messages and are reused as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from aiollm.actors.messages import Message
from aiollm.actors.ref import ActorRef


class Admit(Message, tag="fd.admit"):
    """S-worker -> R-worker (ask, reply `RLoad`): hold this sequence; refused with KVCacheFull when full."""

    # the sequence's id on this R-worker (chosen by the S-worker, unique among its live sequences)
    seq: int
    # the name its KV is pulled under (`PullKV.request_id`)
    request_id: str
    # KV entries of the prompt (tokens already processed)
    n_tokens: int
    # KV entries to reserve: prompt + completion, so a step never runs out of blocks
    max_len: int
    # the actor that streams the prompt's KV (`PullKV` -> `KVBlock`s, then `AckKV`); None holds
    # `n_tokens` zero-valued entries instead (load tests that need long contexts without prefilling them)
    source: ActorRef | None = None
    # the S-worker or decode instance the sequence belongs to: the R-worker watches it and frees everything it
    # holds for it when it dies (a restarted owner starts with none of its old sequences)
    owner: ActorRef | None = None


class Attend(Message, tag="fd.attend"):
    """S-worker -> R-worker (ask, reply `Attended`): one layer of attention for a group of its sequences."""

    # mini-batch (0 or 1 with the pipeline, 0 without) whose step this is
    group: int
    # the layer
    layer: int
    # int64 [b] sequence ids, at layer 0 only (the step appends one token to each); None at later layers
    seqs: np.ndarray | None
    # [b, n_heads + 2 * n_kv_heads, head_dim]: each new token's queries (after RoPE), then its keys (after
    # RoPE), then its values (appended to the cache); one tensor, so one buffer on the wire per ask
    qkv: torch.Tensor
    # int64 [b] KV entries each sequence holds before this step, at layer 0 only (with `seqs`): the new
    # entry goes at that position, so a step repeated after an R-worker loss overwrites, never appends twice
    positions: np.ndarray | None = None


class Attended(Message, tag="fd.attended"):
    """Reply to `Attend`: the attention output."""

    # [b, n_heads, head_dim], fp32 (or bf16 when q was bf16)
    o: torch.Tensor


class Release(Message, tag="fd.release"):
    """S-worker -> R-worker (tell): these sequences finished or were cancelled; free their blocks."""

    # sequence ids
    seqs: list[int]


class RWorkerMoved(Message, tag="fd.r_worker_moved"):
    """Launcher -> decode instance (ask, reply None): one of its R-workers was started again at another address
    (its host was lost); what it held is gone, the instance places on it again once it answers there."""

    # the R-worker's position in the decode instance's list (as wired at its start)
    index: int
    # its actor's new URL
    url: str


class GetRLoad(Message, tag="fd.get_load"):
    """Ask an R-worker for its load (reply `RLoad`)."""


class RLoad(Message, tag="fd.load"):
    """An R-worker's load: what the S-worker balances on, and what its budget still allows."""

    # sequences held
    sequences: int
    # KV entries held now (the R-part's work per step is proportional to this)
    tokens: int
    # KV entries reserved (held + still to come up to each sequence's max_len)
    reserved_tokens: int
    blocks_used: int
    blocks_total: int
    block_size: int
    # KV storage: "fp32", "fp16", "int8" or "int4"
    dtype: str
    # CPU seconds this R-worker's process has used since it started (its share of a step's work, measured)
    cpu_s: float = 0.0


class Synthetic(Message, tag="fd.synthetic"):
    """Load test -> S-worker (ask, reply None once they decode): sequences with placeholder contexts.

    Each starts with `context_lens[i]` zero-valued KV entries held on an R-worker (nothing is
    prefilled), so a benchmark can measure steady-state steps at long contexts without first
    generating them; the tokens they produce are not sent anywhere."""

    # KV entries each sequence starts with
    context_lens: list[int]
    # tokens each one decodes (end-of-sequence ignored)
    max_tokens: int


class GetTrace(Message, tag="fd.get_trace"):
    """Ask the S-worker for its per-step trace (reply `Trace`)."""

    # forget the steps returned
    reset: bool = False


class Trace(Message, tag="fd.trace"):
    """The S-worker's decode steps since the last reset, oldest first."""

    # wall seconds of each step (S-part, R-part round trips, sampling)
    step_s: list[float]
    # sequences in each step
    batch: list[int]
    # KV entries held over all R-workers at each step (the R-part's work)
    tokens: list[int]
    # sequences started (prefilled) just before each step
    started: list[int]
    # the S-worker's time.perf_counter() at the end of each step (gaps between steps include prefills)
    ended: list[float]
    # sequences re-placed on surviving R-workers (re-prefilled) after an R-worker was lost, since the start
    recovered: int = 0
    # CPU seconds the S-worker's process used during each step (its S-part and its side of the round trips)
    cpu_s: list[float] = []
