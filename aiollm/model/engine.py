"""Colocated generation: S-part and R-part in one process, no actors — the tests' oracle and the
single-process baseline the benchmarks compare the disaggregated system against.

A batch of prompts of different lengths is prefilled as one packed batch (their K/V written into
a paged KV pool), then decoded together one token per step; a sequence leaves the batch as soon
as it stops and its blocks go back to the allocator.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aiollm.kv.blocks import BlockAllocator, BlockTable
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.model.decode import decode_logits
from aiollm.model.llama import LlamaModel
from aiollm.model.sampling import SamplingParams, new_generator, sample


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


@dataclass
class _Sequence:
    """Decode-time state of one prompt."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None

    @property
    def length(self) -> int:
        """Prompt and generated tokens so far."""
        return len(self.prompt) + len(self.output)


class ColocatedEngine:
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
        self.pool = KVPool(
            KVConfig(
                n_layers=c.n_layers,
                n_blocks=n_blocks,
                block_size=block_size,
                n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim,
                dtype=kv_dtype,
            )
        )
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
        eos = frozenset(self.model.tokenizer.stop_ids if self.model.tokenizer else self.model.config.eos_ids)
        seqs = [
            _Sequence(
                list(p), sp, frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos), new_generator(sp)
            )
            for p, sp in zip(prompts, params)
        ]
        table = BlockTable(self.allocator, self.block_size)  # sequence index -> its blocks and cached length
        try:
            with torch.inference_mode():
                self._prefill(seqs, table)
                active = [i for i, s in enumerate(seqs) if s.finish is None]
                while active:
                    self._decode_step(seqs, active, table)
                    active = [i for i in active if seqs[i].finish is None]
        finally:
            for i in range(len(seqs)):
                if i in table:
                    table.free(i)
        return [Completion(s.prompt, s.output, s.text, s.finish) for s in seqs]

    def _prefill(self, seqs: list[_Sequence], table: BlockTable) -> None:
        ids = list(range(len(seqs)))
        slots = torch.from_numpy(table.append_batch(ids, [len(s.prompt) for s in seqs]))
        logits = self.model.prefill(
            [s.prompt for s in seqs], kv_sink=lambda layer, k, v: self.pool.write(layer, slots, k, v)
        )
        self._append(seqs, logits)

    def _decode_step(self, all_seqs: list[_Sequence], active: list[int], table: BlockTable) -> None:
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
        self._append(seqs, logits)

    def _append(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample each sequence's next token and decide whether it stops."""
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        decode = self.model.tokenizer.decode if self.model.tokenizer is not None else lambda ids: ""
        for s, token in zip(seqs, tokens):
            s.output.append(token)
            cut = _cut_at_stop_string(decode(s.output), s.params.stop) if s.params.stop else None
            if token in s.stop_ids or cut is not None:
                s.finish = "stop"
            elif len(s.output) >= s.params.max_tokens or s.length >= self.model.config.max_context:
                s.finish = "length"
            if s.finish is not None:
                s.text = cut if cut is not None else decode(s.output)


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
    engine = ColocatedEngine(model, kv_dtype=kv_dtype, n_blocks=max(blocks, 1), block_size=block_size)
    return engine.generate(prompts, params)
