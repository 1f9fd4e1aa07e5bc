"""The reference engine: S-part and R-part in one process, no actors — the tests' oracle and the
single-process baseline the benchmarks compare the disaggregated system against.

A batch of prompts of different lengths is prefilled as one packed batch (their K/V written into
a paged KV pool), then decoded together one token per step; a sequence leaves the batch as soon
as it stops and its blocks go back to the allocator.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiollm.kv.blocks import BlockAllocator, BlockTable
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.model.decode import decode_logits
from aiollm.model.llama import LlamaModel
from aiollm.model.logprobs import TokenLogprobs
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import FINISH_STOP, new_sequence, sample_next
from aiollm.model.sequence import Sequence as SequenceState


@dataclass(frozen=True)
class Completion:
    """What one prompt produced."""

    # the prompt's token ids
    prompt_ids: list[int]
    # generated token ids, including the stop token when one ended it
    token_ids: list[int]
    # generated text, special tokens removed, cut before a stop string
    text: str
    # "stop" (stop token or string) or "length" (max_tokens or the model's context)
    finish_reason: str
    # per generated token, when the params ask for logprobs (of the raw logits)
    logprobs: list[TokenLogprobs] | None = None


class ReferenceEngine:
    """A model plus its own paged KV pool; `generate` runs batches of prompts to completion."""

    def __init__(
        self,
        model: LlamaModel,
        kv_dtype: str = "fp32",
        n_blocks: int = 4096,
        block_size: int = 16,
        n_threads: int | None = None,
    ) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        self.n_threads = n_threads
        self.pool = KVPool(KVConfig.for_model(c, n_blocks, block_size, kv_dtype))
        _fault_in(self.pool)
        self.allocator = BlockAllocator(n_blocks)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
    ) -> list[Completion]:
        """Complete every prompt (token ids); params is one SamplingParams for all or one per prompt."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        seqs = [new_sequence(str(i), list(p), sp, self.model) for i, (p, sp) in enumerate(zip(prompts, params))]
        texts: dict[int, str] = {}
        table = BlockTable(self.allocator, self.block_size)  # sequence index -> its blocks and cached length
        try:
            with torch.inference_mode():
                self._prefill(seqs, table, texts)
                active = [i for i, s in enumerate(seqs) if s.finish is None]
                while active:
                    self._decode_step(seqs, active, table, texts)
                    active = [i for i in active if seqs[i].finish is None]
        finally:
            for i in range(len(seqs)):
                if i in table:
                    table.free(i)
        return [Completion(s.prompt, s.output, texts[i], s.finish, s.logprobs) for i, s in enumerate(seqs)]

    def _prefill(self, seqs: list[SequenceState], table: BlockTable, texts: dict[int, str]) -> None:
        ids = list(range(len(seqs)))
        slots = torch.from_numpy(table.append_batch(ids, [len(s.prompt) for s in seqs]))
        logits = self.model.prefill(
            [s.prompt for s in seqs], kv_sink=lambda layer, k, v: self.pool.write(layer, slots, k, v)
        )
        self._append(seqs, ids, logits, texts)

    def _decode_step(
        self, all_seqs: list[SequenceState], active: list[int], table: BlockTable, texts: dict[int, str]
    ) -> None:
        """Feed each active sequence's last sampled token through every layer and sample the next one."""
        seqs = [all_seqs[i] for i in active]
        positions = [table.length(i) for i in active]  # the fed token's position = tokens already cached
        slots = table.append_batch(active, [1] * len(active))  # numpy: the kernel wrapper's native kind
        logits = decode_logits(
            self.model,
            self.pool,
            [s.output[-1] for s in seqs],
            positions,
            slots,
            table.block_tables(active),
            table.seq_lens(active),
            self.n_threads,
        )
        self._append(seqs, active, logits, texts)

    def _append(
        self, seqs: list[SequenceState], indices: list[int], logits: torch.Tensor, texts: dict[int, str]
    ) -> None:
        """Sample each sequence's next token and decide whether it stops (stop strings too: the text is here)."""
        sample_next(seqs, logits)
        decode = self.model.tokenizer.decode if self.model.tokenizer is not None else lambda ids: ""
        for i, s in zip(indices, seqs):
            cut = _cut_at_stop_string(decode(s.output), s.params.stop) if s.params.stop else None
            if cut is not None:
                s.finish = FINISH_STOP
            if s.finish is not None:
                texts[i] = cut if cut is not None else decode(s.output)


def _fault_in(pool: KVPool) -> None:
    """Write every page of the pool once, now: its arrays come from calloc, whose pages the kernel maps on
    first write, so otherwise each step that opens fresh blocks pays those faults inside its KV write
    (SmolLM2 fp32 batch 64, the first batch to reach its blocks: KV write ~8 vs ~5 ms a step). A serving
    engine holds its pool for its whole life, so this is paid once, at start-up."""
    for arr in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if arr is not None:
            arr.fill(0)


def _cut_at_stop_string(text: str, stops: tuple[str, ...]) -> str | None:
    """The text before the first stop string in it, or None when it holds none."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[: min(found)] if found else None


def generate(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    kv_dtype: str = "fp32",
    block_size: int = 16,
) -> list[Completion]:
    """Complete a batch of token-id prompts with a KV pool sized for exactly this batch."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    blocks = sum(math.ceil((len(p) + sp.max_tokens) / block_size) for p, sp in zip(prompts, params))
    engine = ReferenceEngine(model, kv_dtype=kv_dtype, n_blocks=max(blocks, 1), block_size=block_size)
    return engine.generate(prompts, params)
