"""One model step over many sequences: prefill (sample the first token) and a decode step over a
paged KV cache, shared by the prefill instance, the decode instance and the colocated engine.

Why here and not in the model: these functions add what serving needs around the model's split
forward — per-request sampling state, stop rules, block reservation for the whole completion — while
the model stays a pure forward. Every function is synchronous (torch releases the GIL), so an actor
runs it with `asyncio.to_thread` and keeps its event loop answering messages during a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aiollm.kv.blocks import BlockAllocator
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.model.decode import decode_logits
from aiollm.model.llama import LlamaModel
from aiollm.model.sequence import Sequence, sample_next

# (layer, k, v) of a packed prefill batch, k/v [n_tokens, n_kv_heads, head_dim]
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


class PagedCache:
    """A paged KV pool with its allocator; a sequence reserves blocks for its whole completion up front."""

    def __init__(self, model: LlamaModel, n_blocks: int, block_size: int = 16, dtype: str = "fp32") -> None:
        c = model.config
        self.block_size = block_size
        self.pool = KVPool(KVConfig.for_model(c, n_blocks, block_size, dtype))
        self.allocator = BlockAllocator(n_blocks)
        self.total_blocks = n_blocks
        self.used_blocks = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def reserve(self, seq: Sequence, tokens: int | None = None) -> None:
        """Allocate the blocks `seq` needs for `tokens` KV entries (default: to its end)."""
        need = self.blocks_for(seq.max_length if tokens is None else tokens) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.allocator.allocate(need)
            self.used_blocks += need

    def free(self, seq: Sequence) -> None:
        if seq.blocks:
            self.allocator.free(seq.blocks)
            self.used_blocks -= len(seq.blocks)
            seq.blocks = []

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def write(self, seq: Sequence, start: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of positions [start, start + len(k)) of one sequence at one layer."""
        slots = torch.tensor(self.slots(seq, start, start + k.shape[0]), dtype=torch.int64)
        self.pool.write(layer, slots, k, v)


def prefill(model: LlamaModel, seqs: list[Sequence], sink: KVSink) -> list[int]:
    """Run the prompts as one packed batch, hand every layer's K/V to `sink`, sample the first tokens."""
    with torch.inference_mode():
        logits = model.prefill([s.prompt for s in seqs], kv_sink=sink)
        return sample_next(seqs, logits)


def prefill_into(model: LlamaModel, cache: PagedCache, seqs: list[Sequence]) -> list[int]:
    """Prefill straight into a paged cache (blocks already reserved): the colocated path."""
    slots = torch.tensor([slot for s in seqs for slot in cache.slots(s, 0, len(s.prompt))], dtype=torch.int64)
    return prefill(model, seqs, lambda layer, k, v: cache.pool.write(layer, slots, k, v))


def decode_step(model: LlamaModel, cache: PagedCache, seqs: list[Sequence], n_threads: int | None = None) -> list[int]:
    """One token for every sequence: feed each one's last token, attend over its cached K/V."""
    positions = [s.length - 1 for s in seqs]
    slots = torch.tensor([cache.slots(s, p, p + 1)[0] for s, p in zip(seqs, positions)], dtype=torch.int64)
    width = max(len(s.blocks) for s in seqs)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int32)
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
    logits = decode_logits(
        model, cache.pool, [s.output[-1] for s in seqs], positions, slots, tables, seq_lens, n_threads
    )
    with torch.inference_mode():
        return sample_next(seqs, logits)
