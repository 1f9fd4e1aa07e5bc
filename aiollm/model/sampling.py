"""Choosing the next token: greedy, or temperature with top-k / top-p / min-p, reproducible with a seed.

`SamplingParams` is what a request carries (frozen, validated once at the edge); `sample` turns a
batch of fp32 logits into token ids, each row with its own parameters and its own `Draws`, so a
seeded request gives the same tokens whatever else shares its batch. A row with logit_bias,
min_tokens or penalties goes through `logits_processors.process` first (greedy rows too: their
argmax is taken after it); every other greedy row takes the batch's one native argmax. The rows of a
request with a `response_format` arrive already masked by its grammar (`sequence.sample_next`).

A request's random draws are keyed by its seed and the index of the token being drawn, not by a
generator's running state: token i is drawn from a generator seeded with mix(seed, i). A request
resumed elsewhere after n tokens (its instance died; the prompt now holds those n tokens) starts at
index n (`first_index`) and draws exactly what the uninterrupted request would have drawn.
"""

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from aiollm.model.logits_processors import RowHistory, apply_min_p, process
from aiollm.model.logprobs import MAX_TOP_LOGPROBS
from aiollm.native import fused_ops

# Bounds the wire (int64, msgpack) and the sampler (fp32 logits) can hold; a value outside is refused at the door.
MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0
# Below this a temperature only sharpens the distribution onto its argmax (fp32 logits), and dividing by a
# value near 0 overflows: such requests are sampled greedily, as vLLM does.
GREEDY_BELOW = 1e-5
# OpenAI's bounds: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100]
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request's completion is sampled and when it stops."""

    # most tokens to generate
    max_tokens: int = 16
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling
    temperature: float = 0.0
    # keep only the k most likely tokens (0: all)
    top_k: int = 0
    # keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all)
    top_p: float = 1.0
    # seed of this request's own generator (None: drawn from torch's global generator)
    seed: int | None = None
    # strings that end the completion; the text is cut before the first one
    stop: tuple[str, ...] = ()
    # token ids that end the completion, besides the model's end-of-sequence ids
    stop_token_ids: tuple[int, ...] = ()
    # keep generating past the model's end-of-sequence ids (benchmarks: a fixed number of tokens)
    ignore_eos: bool = False
    # subtracted from a token's logit once it appears in the output (OpenAI's presence_penalty)
    presence_penalty: float = 0.0
    # subtracted from a token's logit per time it appears in the output (OpenAI's frequency_penalty)
    frequency_penalty: float = 0.0
    # a token seen in the prompt or output has a positive logit divided by it, a negative one multiplied (HF/vLLM)
    repetition_penalty: float = 1.0
    # the stop ids (EOS and stop_token_ids) cannot be drawn before this many tokens were generated
    min_tokens: int = 0
    # drop tokens whose probability is below min_p times the most likely token's (0: off)
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits, bias in [-100, 100] (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no logprobs; k: each sampled token's logprob and the k most likely tokens' (0..20)
    logprobs: int | None = None
    # the output is JSON (OpenAI's response_format json_object): xgrammar's built-in JSON grammar
    json_object: bool = False
    # the output is JSON following this JSON schema (its text; OpenAI's response_format json_schema)
    json_schema: str | None = None

    # index of the first token this run draws: the tokens a request already generated before it was
    # resumed (its prompt then ends with them); seeded draws are keyed by token index
    first_index: int = 0

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT)
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0, MAX_INT)
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be a tuple of non-empty strings, got {self.stop!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, MAX_INT)
        _check_int("first_index", self.first_index, 0, MAX_INT)
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty!r}")
        # min_tokens counts from the request's first token; after a resume max_tokens counts from first_index
        _check_int("min_tokens", self.min_tokens, 0, self.first_index + self.max_tokens)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if isinstance(self.logit_bias, str | dict):
            raise ValueError(f"logit_bias: must be a tuple of (token id, bias) pairs, got {self.logit_bias!r}")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"logit_bias: must be (token id, bias) pairs, got {pair!r}")
            _check_int("logit_bias", pair[0], 0, MAX_INT)
            _check_float("logit_bias", pair[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object: must be a bool, got {self.json_object!r}")
        if self.json_schema is not None and (not isinstance(self.json_schema, str) or self.json_object):
            raise ValueError(f"json_schema: must be a schema's text, without json_object, got {self.json_schema!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def structured(self) -> bool:
        """Whether the output must be JSON (a grammar masks the logits before anything else)."""
        return self.json_object or self.json_schema is not None

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether logit_bias, min_tokens or a penalty changes the logits before the argmax."""
        return bool(self.logit_bias or self.min_tokens or self.penalised)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name}: must be a number in [{low:g}, {high:g}], got {value!r}")


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit over the output."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n` choices: the request's own for the first, a distinct one
    derived from it for the others, so `n` choices with one seed are distinct draws and reproducible."""
    if index == 0:
        return seed
    return _mix64(_mix64(seed) + index * 0xD1B54A32D192ED03) >> 1


class Draws:
    """The random draws of one request, keyed by (seed, token index): `next()` is the generator for the
    token at `index`, then moves on to the next index."""

    def __init__(self, seed: int, index: int = 0) -> None:
        self.seed, self.index = seed, index

    def next(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(_mix64(_mix64(self.seed) ^ (self.index * 0x9E3779B97F4A7C15)) >> 1)
        self.index += 1
        return generator


def new_draws(params: SamplingParams) -> Draws | None:
    """The draws of one request from its first token to draw: seeded if asked, None for greedy (it draws
    nothing)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().randrange(MAX_SEED)
    return Draws(seed, params.first_index)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit of a 1-D row below min-p, outside the top-k and outside the top-p nucleus (in that
    order, as vLLM applies them)."""
    logits = apply_min_p(logits, min_p)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is already full
        logits = logits.clone()
        logits[order[outside]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    draws: Sequence[Draws | None],
    histories: Sequence[RowHistory | None] | None = None,
    masked: Mapping[int, torch.Tensor] | None = None,
) -> list[int]:
    """Next token of each row of fp32 logits [b, vocab]; row i uses params[i], draws[i] and, when its params
    process the logits (penalties, min_tokens), histories[i]. `masked[i]`, when given, replaces row i: its logits
    with the tokens a grammar refuses at -inf. `logits` is never changed in place.

    A row whose distribution is not finite (a model that produced NaN for it) takes its argmax instead of
    failing the batch: one request's numbers never cost the others their step."""
    if logits.shape[0] != len(params):
        raise ValueError(f"params: {len(params)} given for {logits.shape[0]} rows of logits")
    masked = masked or {}
    native = fused_ops.native(logits) and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    tokens = (fused_ops.argmax(logits) if native else logits.argmax(dim=-1)).tolist()
    for i, p in enumerate(params):
        own = masked.get(i)
        if p.greedy and not p.processed and own is None:
            continue
        row = own if own is not None else logits[i]
        if p.processed:
            row = process(row, p, histories[i] if histories is not None else None)
        if p.greedy or own is not None:
            tokens[i] = int(row.argmax())  # a masked row's fallback too: the most likely token it allows
        if p.greedy:
            continue
        generator = draws[i].next()  # drawn even when the row falls back, so later indices stay aligned
        probs = torch.softmax(filter_logits(row.float() / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
        if not math.isfinite(float(probs.sum())):
            continue
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
