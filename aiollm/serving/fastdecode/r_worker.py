"""FastDecode's R-worker: keeps sequences' KV caches in its own RAM and runs their attention there.

Why a separate actor: the R-part (attention over each sequence's own KV) has no weights and is
bound by memory bandwidth, so it scales with cheap CPU sockets and RAM while the S-worker keeps
the dense, batched part. Only the new token's q/k/v come in and the attention output goes back;
the KV never leaves this process after admission.

Admission reserves blocks for the sequence's whole `max_len` up front (all or nothing), so a
step never runs out of memory and a refused admission (KVCacheFull, naming this worker and its
budget) leaves every admitted sequence untouched. The prompt's KV is pulled as an actor stream
(`PullKV` -> `KVBlock`) from whoever holds it, with a credit window of the blocks reserved.

Threads: attention runs inline in the actor loop (the process has nothing else to do, and a
thread hop per layer costs more than it gains); the native kernel uses `threads` pool threads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Terminated
from aiollm.errors import KVCacheFull
from aiollm.kv.blocks import BlockAllocator
from aiollm.kv.pool import DEFAULT_KV_DTYPE, KVConfig, KVPool
from aiollm.log import get_logger
from aiollm.serving.distserve.messages import AckKV, KVBlock, PullKV
from aiollm.serving.fastdecode.messages import Admit, Attend, Attended, GetRLoad, Release, RLoad

if TYPE_CHECKING:
    pass


_log = get_logger("r_worker")


class AdmissionRefused(KVCacheFull):
    """An R-worker's KV budget cannot hold one more sequence; nothing it holds was touched."""

    def __init__(self, full: KVCacheFull, text: str) -> None:
        super().__init__(full.requested, full.free, full.total)
        self.args = (f"{text} ({full})",)


class SequenceStore:
    """The paged KV of the sequences one R-worker holds: whole-life reservations, per-step tables."""

    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.pool = KVPool(config)
        self.allocator = BlockAllocator(config.n_blocks)
        # seq id -> its blocks (reserved up to max_len), its length (KV entries held), its max_len
        self.blocks: dict[int, np.ndarray] = {}
        self.lengths: dict[int, int] = {}
        self.max_lens: dict[int, int] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def admit(self, seq: int, n_tokens: int, max_len: int) -> None:
        """Reserve blocks for `max_len` entries, the first `n_tokens` of which will be held; KVCacheFull if short."""
        if seq in self.lengths:
            raise ValueError(f"seq: {seq} is already held here")
        if not 0 < n_tokens < max_len:
            raise ValueError(f"need 0 < n_tokens < max_len, got n_tokens={n_tokens}, max_len={max_len}")
        # whole-life reservation in as few runs as the pool has, ascending: attention reads a sequence's blocks in
        # table order (SmolLM2, 128 x 256 entries: ascending 1750, descending 1836, scattered 2178 ns per entry)
        self.blocks[seq] = np.asarray(self.allocator.allocate(self.blocks_for(max_len)), dtype=np.int32)
        self.lengths[seq] = n_tokens
        self.max_lens[seq] = max_len

    def fill_zeros(self, seq: int) -> None:
        """Write zeros into every block of `seq`, so its memory is really allocated (untouched pages would all
        map the kernel's one shared zero page and make attention over them look faster than it is)."""
        at = self.blocks[seq]
        for arr in (self.pool.k, self.pool.v, self.pool.k_scale, self.pool.v_scale):
            if arr is not None:
                arr[:, at] = 0

    def ingest(self, seq: int, block: KVBlock) -> None:
        """Import one raw block of every layer (the pull stream's item) at the sequence's block `block.index`."""
        blocks = self.blocks[seq]
        if not 0 <= block.index < len(blocks):
            raise ValueError(f"KV block {block.index} outside the {len(blocks)} blocks of sequence {seq}")
        self.pool.write_blocks(
            None, [int(blocks[block.index])], block.k, block.v, k_scale=block.k_scale, v_scale=block.v_scale
        )

    def begin_step(self, seqs: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Put each sequence's new entry at `positions[i]` (the entries it held before the step); returns
        (slot_mapping int64, block_tables int32, seq_lens int32) of the step.

        The position comes from the S-worker, not from a counter here, so a step that is run again after
        another R-worker was lost (this one may have taken part of it already) overwrites its own entry."""
        if len(positions) != len(seqs):
            raise ValueError(f"positions: {len(positions)} for {len(seqs)} sequences")
        bs = self.config.block_size
        lens = np.asarray(positions, np.int32) + 1
        for s, n in zip(seqs.tolist(), lens.tolist()):
            held = self.lengths[s]
            if n > self.max_lens[s]:
                raise ValueError(f"sequence {s} is at its reserved length {self.max_lens[s]}")
            if n > held + 1:
                raise ValueError(f"sequence {s} holds {held} entries; position {n - 1} would leave a gap")
        width = int(self.blocks_for(int(lens.max()))) if len(seqs) else 0
        tables = np.full((len(seqs), width), -1, np.int32)
        slots = np.empty(len(seqs), np.int64)
        for i, s in enumerate(seqs.tolist()):
            row = self.blocks[s]
            used = self.blocks_for(int(lens[i]))
            tables[i, :used] = row[:used]
            slots[i] = int(row[(lens[i] - 1) // bs]) * bs + (lens[i] - 1) % bs
            self.lengths[s] = int(lens[i])
        return torch.from_numpy(slots), torch.from_numpy(tables), torch.from_numpy(lens)

    def release(self, seq: int) -> None:
        blocks = self.blocks.pop(seq, None)
        if blocks is None:
            return
        self.allocator.free(blocks.tolist())
        del self.lengths[seq], self.max_lens[seq]

    def load(self) -> RLoad:
        c = self.config
        return RLoad(
            sequences=len(self.lengths),
            tokens=sum(self.lengths.values()),
            reserved_tokens=sum(self.max_lens.values()),
            blocks_used=c.n_blocks - self.allocator.n_free,
            blocks_total=c.n_blocks,
            block_size=c.block_size,
            dtype=c.dtype,
            cpu_s=time.process_time(),
        )


class RWorker(Actor):
    """Holds sequences' KV and answers per-layer attention for them."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        kv_memory: int,
        kv_dtype: str = DEFAULT_KV_DTYPE,
        block_size: int = 16,
        threads: int = 1,
        window: int = 0,
    ) -> None:
        self.kv_memory = int(kv_memory)
        self.store = SequenceStore(
            KVConfig.from_budget(
                self.kv_memory,
                n_layers=n_layers,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                dtype=kv_dtype,
                window=window,
            )
        )
        self.threads = int(threads)
        # mini-batch group -> (its row count, the step's checked index arrays: aiollm.kv DecodeStep)
        self._steps: dict[int, tuple] = {}
        # owner actor URL -> the sequences held for it; sequence -> its owner's URL
        self._owned: dict[str, set[int]] = {}
        self._owner_of: dict[int, str] = {}

    @handler(Admit)
    async def admit(self, msg: Admit) -> RLoad:
        store = self.store
        try:
            store.admit(msg.seq, msg.n_tokens, msg.max_len)
        except KVCacheFull as exc:
            free = store.allocator.n_free * store.config.bytes_per_block
            raise AdmissionRefused(
                exc,
                f"R-worker {self.name} refuses sequence {msg.request_id}: its KV budget "
                f"({self.kv_memory / 2**30:.3g} GiB of {store.config.dtype}) has "
                f"{free / 2**20:.1f} MiB free, {msg.max_len} tokens need "
                f"{store.blocks_for(msg.max_len) * store.config.bytes_per_block / 2**20:.1f} MiB",
            ) from None
        if msg.source is None:
            store.fill_zeros(msg.seq)
        else:
            try:
                window = store.blocks_for(msg.n_tokens)
                async for block in msg.source.stream(PullKV(msg.request_id), window=window):
                    store.ingest(msg.seq, block)
                await msg.source.tell(AckKV(msg.request_id))
            except BaseException:
                store.release(msg.seq)
                raise
        if msg.owner is not None:
            await self._own(msg.owner, msg.seq)
        return store.load()

    async def _own(self, owner, seq: int) -> None:
        if owner.url not in self._owned:
            self._owned[owner.url] = set()
            await self.watch(owner)
        self._owned[owner.url].add(seq)
        self._owner_of[seq] = owner.url

    @handler(Terminated)
    async def on_owner_lost(self, msg: Terminated) -> None:
        """An owner died: nobody will step or release its sequences any more, so free them all now."""
        seqs = self._owned.pop(msg.url, set())
        for seq in seqs:
            self._owner_of.pop(seq, None)
            self.store.release(seq)
        if seqs:
            _log.warning("owner lost: its sequences freed", owner=msg.url, sequences=len(seqs), reason=msg.reason)

    @handler(Attend)
    async def attend(self, msg: Attend) -> Attended:
        if msg.seqs is not None:
            if msg.positions is None:
                raise ValueError(f"Attend group {msg.group}: seqs without positions")
            # the step's index arrays are checked once here and serve every layer (checking them per layer
            # in pool.write/pool.attend cost ~0.5 ms of each layer's ~0.7 ms round trip at 8 rows)
            self._steps[msg.group] = (
                len(msg.seqs),
                self.store.pool.prepare_decode(*self.store.begin_step(msg.seqs, msg.positions)),
            )
        qkv = msg.qkv
        step = self._steps.get(msg.group)
        if step is None or step[0] != qkv.shape[0]:
            raise ValueError(
                f"Attend group {msg.group} layer {msg.layer}: no step begun for these "
                f"{qkv.shape[0]} rows (send seqs with layer 0)"
            )
        kv_heads = self.store.config.n_kv_heads
        q_heads = qkv.shape[1] - 2 * kv_heads if qkv.dim() == 3 else 0
        if q_heads <= 0:
            raise ValueError(
                f"Attend qkv: expected [rows, q heads + 2 x {kv_heads} KV heads, head_dim], got {list(qkv.shape)}"
            )
        # the kernel writes fp32 or bf16 directly: bf16 in, bf16 back (half the bytes)
        out = torch.empty(
            (qkv.shape[0], q_heads, qkv.shape[2]),
            dtype=torch.bfloat16 if qkv.dtype == torch.bfloat16 else torch.float32,
        )
        step[1].write_attend(msg.layer, qkv, out, n_threads=self.threads)
        return Attended(out)

    @handler(Release)
    async def release(self, msg: Release) -> None:
        for seq in msg.seqs:
            self.store.release(seq)
            owner = self._owner_of.pop(seq, None)
            if owner is not None:
                self._owned[owner].discard(seq)

    @handler(GetRLoad)
    async def get_load(self, msg: GetRLoad) -> RLoad:
        return self.store.load()
