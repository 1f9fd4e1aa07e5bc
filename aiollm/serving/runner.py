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

from aiollm.errors import KVCacheFull
from aiollm.kv.blocks import BlockAllocator
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.kv.prefix_cache import BlockCache, block_hashes
from aiollm.model.decode import decode_logits
from aiollm.model.llama import LlamaModel
from aiollm.model.prefix_prefill import prefill_after
from aiollm.model.sequence import Sequence, sample_next

# Prompt tokens a prefill computes at least, however much of the prompt is cached: one gives the logits of the
# first output token; the native GEMM takes another path below 4 rows (a few fp32 ulps apart), so 4 keep the
# logits and the K/V the bits a whole prefill gives.
MIN_COMPUTED = 4

# (layer, k, v) of a packed prefill batch, k/v [n_tokens, n_kv_heads, head_dim]
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


class PagedCache:
    """A paged KV pool with its allocator; a sequence reserves blocks for its whole completion up front.

    With `prefix_cache`, the full blocks of prompts are kept after their sequences end, named by their chained
    hashes (aiollm.kv.prefix_cache.BlockCache): `reserve(seq, reuse=n)` maps the cached blocks of the longest
    cached prefix of the prompt (up to n tokens) into a new sequence, and `commit` names the prompt's full
    blocks once their KV is written, so later prompts can map them. `used_blocks` counts referenced blocks;
    cached blocks nobody references count as free (an allocation evicts them when no plain free block is left).
    """

    def __init__(
        self, model: LlamaModel, n_blocks: int, block_size: int = 16, dtype: str = "fp32", prefix_cache: bool = False
    ) -> None:
        c = model.config
        self.block_size = block_size
        self.pool = KVPool(KVConfig.for_model(c, n_blocks, block_size, dtype))
        self.allocator = BlockAllocator(n_blocks)
        self.blocks = BlockCache(self.allocator)
        self.prefix_cache = prefix_cache
        self.total_blocks = n_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return self.blocks.n_available

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.blocks.n_available

    def cached_prefix(self, seq: Sequence, reuse: int) -> int:
        """Tokens of `seq`'s prompt that `reserve(..., reuse=reuse)` would map from the cache now."""
        if seq.blocks:
            return seq.cached_tokens
        if not self.prefix_cache or reuse < self.block_size:
            return 0
        if not seq.block_hashes:
            seq.block_hashes = block_hashes(seq.prompt, self.block_size)
        return self.blocks.match(seq.block_hashes[: max(0, reuse) // self.block_size]) * self.block_size

    def reserve(self, seq: Sequence, tokens: int | None = None, reuse: int = 0) -> None:
        """Allocate the blocks `seq` needs for `tokens` KV entries (default: to its end). With the prefix cache
        on and `seq` holding no blocks yet, first map the cached blocks of its prompt's longest cached prefix
        of at most `reuse` tokens (`seq.cached_tokens` says how many). KVCacheFull leaves everything unchanged."""
        total = self.blocks_for(seq.max_length if tokens is None else tokens)
        n_hit = 0 if seq.blocks else self.cached_prefix(seq, reuse) // self.block_size  # hashes the prompt
        hit = seq.block_hashes[:n_hit]
        need = total - len(seq.blocks) - len(hit)
        if need > 0:
            revived = sum(self.blocks.is_evictable(b) for b in self.blocks.lookup(hit))
            if need > self.blocks.n_available - revived:
                raise KVCacheFull(need, self.blocks.n_available - revived, self.total_blocks)
        if not seq.blocks:
            seq.blocks = self.blocks.acquire_cached(hit)
            seq.cached_tokens = len(hit) * self.block_size
        if need > 0:
            seq.blocks += self.blocks.allocate(need)

    def commit(self, seq: Sequence, tokens: int) -> None:
        """Name the full blocks among `seq`'s first `tokens` prompt tokens (their KV written) by their hashes."""
        if not self.prefix_cache:
            return
        if len(seq.block_hashes) < tokens // self.block_size:
            seq.block_hashes = block_hashes(seq.prompt, self.block_size)
        for block, block_hash in zip(seq.blocks[: tokens // self.block_size], seq.block_hashes):
            self.blocks.register(block, block_hash)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references: its cached blocks stay (evictable once nobody else holds them)."""
        if seq.blocks:
            self.blocks.release(seq.blocks)
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
    """Prefill straight into a paged cache (blocks already reserved): the colocated path. A sequence whose first
    `cached_tokens` prompt tokens were mapped from the prefix cache computes only the rest, over their K/V."""
    slots = torch.tensor(
        [slot for s in seqs for slot in cache.slots(s, s.cached_tokens, len(s.prompt))], dtype=torch.int64
    )
    sink = lambda layer, k, v: cache.pool.write(layer, slots, k, v)
    if not any(s.cached_tokens for s in seqs):
        return prefill(model, seqs, sink)

    def past(layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = seqs[i]
        k, v = cache.pool.read_tokens(layer, seq.blocks[: seq.cached_tokens // cache.block_size])
        return torch.from_numpy(k), torch.from_numpy(v)

    with torch.inference_mode():
        logits = prefill_after(
            model, [s.prompt[s.cached_tokens :] for s in seqs], [s.cached_tokens for s in seqs], past, sink
        )
        return sample_next(seqs, logits)


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
