"""`Sequence`: the token state of one request, the one type every engine and serving role decodes with.

A sequence holds its prompt, what it generated, how to sample (params and its own seeded generator), which
tokens end it and how long it may grow; `finish` says why it ended. The serving roles add what they need around
it (where its KV lives, who waits for its tokens) instead of redefining it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from aiollm.log import get_logger
from aiollm.model.llama import LlamaModel
from aiollm.model.logits_processors import RowHistory
from aiollm.model.logprobs import TokenLogprobs, token_logprobs
from aiollm.model.sampling import Draws, SamplingParams, new_draws, sample
from aiollm.model.structured import JsonConstraint, apply_masks, grammar_for, prepare

_log = get_logger("model.sequence")

# Finish reasons, as OpenAI names them.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Sequence:
    """Token state of one request."""

    request_id: str
    # prompt token ids (after failover: the original prompt plus the tokens already generated)
    prompt: list[int]
    params: SamplingParams
    # token ids that end it: the model's EOS ids (unless ignore_eos) and the request's stop_token_ids
    stop_ids: frozenset[int]
    # its random draws (None: greedy)
    draws: Draws | None
    # most tokens prompt + completion may reach (the model's context)
    max_context: int
    output: list[int] = field(default_factory=list)
    # KV blocks held in a paged cache
    blocks: list[int] = field(default_factory=list)
    # prompt tokens whose KV was mapped from a prefix cache instead of computed or pulled (a whole number of blocks)
    cached_tokens: int = 0
    # the chained hashes of the prompt's full blocks (aiollm.kv.prefix_cache), when a prefix cache is in use
    block_hashes: list[bytes] = field(default_factory=list)
    # FINISH_STOP or FINISH_LENGTH once it ended
    finish: str | None = None
    # tokens sampled here (a decode instance's first token was sampled by the prefill instance)
    drawn: int = 0
    # each token sampled here: its logprobs, when the request asks for them (None when it does not)
    logprobs: list[TokenLogprobs] | None = None
    # the compiled grammar of a request with a response_format (aiollm.model.structured), else None
    grammar: Any = None
    # its matcher, built over the tokens generated so far before the first token is sampled here (`constrain`)
    constraint: JsonConstraint | None = None

    @property
    def length(self) -> int:
        """Prompt and generated tokens so far."""
        return len(self.prompt) + len(self.output)

    @property
    def max_length(self) -> int:
        """KV entries this sequence may need: prompt + max_tokens, capped by the context."""
        return min(len(self.prompt) + self.params.max_tokens, self.max_context)

    @property
    def generated(self) -> int:
        """Tokens generated for the request so far, wherever they were sampled: `first_index` counts those that
        came before this run (the prompt ends with them, or the output starts with the one carried over)."""
        return self.params.first_index + self.drawn

    def last_logprobs(self, n: int) -> list[TokenLogprobs] | None:
        """The logprobs of the last n tokens sampled here, or None when the request does not ask for them."""
        if self.logprobs is None or n <= 0:
            return None
        return self.logprobs[-n:]


def new_sequence(request_id: str, prompt: list[int], params: SamplingParams, model: LlamaModel) -> Sequence:
    eos = frozenset(model.tokenizer.stop_ids if model.tokenizer else model.config.eos_ids)
    stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
    seq = Sequence(request_id, list(prompt), params, stop, new_draws(params), model.config.max_context)
    if params.logprobs is not None:
        seq.logprobs = []
    # compiled here unless cached: serving roles compile in a thread first (aiollm.model.structured.prepare)
    seq.grammar = grammar_for(params, model.tokenizer, model.config.vocab)
    return seq


async def open_sequence(
    request_id: str, prompt: list[int], params: SamplingParams, model: LlamaModel, first_token: int | None = None
) -> Sequence:
    """`new_sequence` for a serving role's handler: a response_format's grammar is compiled in a thread unless
    cached, `first_token` (sampled elsewhere) starts the output, and the grammar's matcher is built over the tokens
    generated so far. ValueError (a schema or tokens the grammar refuses, no xgrammar) fails only this request."""
    await prepare(params, model.tokenizer, model.config.vocab)
    seq = new_sequence(request_id, prompt, params, model)
    if first_token is not None:
        seq.output.append(first_token)
    constrain(seq)
    return seq


def constrain(seq: Sequence) -> None:
    """Build the matcher of a sequence with a grammar, advanced over the tokens it generated so far (the prompt
    ends with those of a resumed request, the output starts with one a prefill instance sampled). A role calls it
    once the sequence holds them (`open_sequence`), to fail only that request on ValueError (tokens the grammar
    refuses); `sample_next` calls it otherwise."""
    if seq.grammar is None or seq.constraint is not None:
        return
    tokens = seq.prompt + seq.output
    seq.constraint = JsonConstraint(seq.grammar, seq.stop_ids, tokens[len(tokens) - seq.generated :])


def sample_next(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Sample each sequence's next token from its row of `logits`, append it, and apply the stop rules (a stop
    id ends it with FINISH_STOP, max_tokens or the context with FINISH_LENGTH). A sequence with a grammar samples
    from the tokens it allows (before any other processor) and advances it; a stop id is allowed only once the
    grammar is complete. A sequence that asks for logprobs gets those of the raw logits appended to `logprobs`."""
    histories = [RowHistory(s.prompt + s.output, s.generated, s.stop_ids) if s.params.processed else None for s in seqs]
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    for i in constrained:
        constrain(seqs[i])
    masked = apply_masks(logits, constrained, [seqs[i].constraint for i in constrained]) if constrained else None
    tokens = sample(logits, [s.params for s in seqs], [s.draws for s in seqs], histories, masked)
    asking = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if asking:
        rows = logits[asking] if len(asking) < len(seqs) else logits
        entries = token_logprobs(rows, [tokens[i] for i in asking], [seqs[i].params.logprobs for i in asking])
        for i, entry in zip(asking, entries):
            seqs[i].logprobs.append(entry)
    for s, token in zip(seqs, tokens):
        s.output.append(token)
        s.drawn += 1
        if s.constraint is not None and (not s.constraint.accept(token) or s.constraint.done):
            if not s.constraint.done:  # only a row with no finite logit left (NaN from the model) gets here
                _log.warning("token outside the grammar ends the request", request_id=s.request_id, token=token)
            s.finish = FINISH_STOP
        elif token in s.stop_ids:
            s.finish = FINISH_STOP
        elif len(s.output) >= s.params.max_tokens or s.length >= s.max_context:
            s.finish = FINISH_LENGTH
    return tokens
