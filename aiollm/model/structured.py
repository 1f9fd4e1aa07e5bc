"""JSON output by constrained decoding (OpenAI's `response_format` json_object / json_schema), with xgrammar.

As vLLM does it: a request's JSON schema (or xgrammar's built-in JSON grammar for json_object) is compiled
once for the model's tokenizer and cached (`GrammarCache`, an LRU keyed by tokenizer, vocabulary size and
schema); each request holds a `JsonConstraint`, a matcher over that grammar. Before a token is chosen the
matcher fills a bitmask of the tokens the grammar allows next and every other logit becomes -inf (greedy and
sampled rows alike); the chosen token then advances the matcher. A stop id (EOS, `stop_token_ids`) is allowed
only once the grammar is complete, so a request ends when its JSON does (or at `max_tokens`, which may cut
it). The matcher is rebuilt wherever the request goes next (a decode instance, a resume after a fault) from
the tokens it generated so far, so its state never travels. xgrammar is imported on first use.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from aiollm.model.sampling import SamplingParams
    from aiollm.model.tokenizer import Tokenizer

# compiled grammars kept per process (each is a few hundred KB for a 50k vocabulary)
CACHE_SIZE = 64

# xgrammar's errors begin with a timestamp, its source file and line, and a failed check's expression
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputUnavailable(ValueError):
    """xgrammar (the grammar library behind `response_format`) is not installed: the request cannot be served."""


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputUnavailable(
            "response_format: JSON output needs the xgrammar package (pip install xgrammar)"
        ) from exc
    return xgrammar


def _reason(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).strip()


def check(params: SamplingParams) -> None:
    """Whether a request's response_format can be followed, tokenizer-independent (the HTTP frontend checks it at
    the door): StructuredOutputUnavailable without xgrammar, ValueError("response_format: <xgrammar's reason>")
    for a schema xgrammar cannot follow."""
    if params.json_schema is not None:
        _check_schema(params.json_schema)
    elif params.json_object:
        _xgr()


@functools.lru_cache(maxsize=CACHE_SIZE)
def _check_schema(schema: str) -> None:
    xgr = _xgr()
    try:
        xgr.Grammar.from_json_schema(schema)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"response_format: invalid JSON schema: {_reason(exc)}") from None


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """("json_object", "") or ("json_schema", the schema's text) for a constrained request, else None."""
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", "")
    return None


class GrammarCache:
    """Compiled grammars by (tokenizer, vocabulary size, grammar key), least recently used evicted first.
    Thread-safe: steps compile in their threads, handlers in `asyncio.to_thread`."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._grammars: OrderedDict[tuple, Any] = OrderedDict()
        # per (tokenizer id, vocab): (the tokenizer, kept so its id stays unique, and its GrammarCompiler)
        self._compilers: dict[tuple[int, int], tuple[Tokenizer, Any]] = {}
        self._lock = threading.Lock()

    def cached(self, tokenizer: Tokenizer, vocab: int, key: tuple[str, str]) -> Any | None:
        with self._lock:
            grammar = self._grammars.get((id(tokenizer), vocab, key))
            if grammar is not None:
                self._grammars.move_to_end((id(tokenizer), vocab, key))
            return grammar

    def compile(self, tokenizer: Tokenizer, vocab: int, key: tuple[str, str]) -> Any:
        """The compiled grammar (from the cache, or compiled now); ValueError naming response_format if the
        schema cannot be compiled."""
        grammar = self.cached(tokenizer, vocab, key)
        if grammar is not None:
            return grammar
        compiler = self._compiler(tokenizer, vocab)
        kind, schema = key
        try:
            if kind == "json_object":
                grammar = compiler.compile_builtin_json_grammar()
            else:
                grammar = compiler.compile_json_schema(schema)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"response_format: invalid JSON schema: {_reason(exc)}") from None
        with self._lock:
            self._grammars[(id(tokenizer), vocab, key)] = grammar
            while len(self._grammars) > self.size:
                self._grammars.popitem(last=False)
        return grammar

    def _compiler(self, tokenizer: Tokenizer, vocab: int) -> Any:
        with self._lock:
            entry = self._compilers.get((id(tokenizer), vocab))
        if entry is not None:
            return entry[1]
        xgr = _xgr()
        from transformers import PreTrainedTokenizerFast

        # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback) from a transformers tokenizer
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(tokenizer.stop_ids))
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        with self._lock:
            self._compilers.setdefault((id(tokenizer), vocab), (tokenizer, compiler))
            return self._compilers[(id(tokenizer), vocab)][1]


GRAMMARS = GrammarCache()


def grammar_for(params: SamplingParams, tokenizer: Tokenizer | None, vocab: int) -> Any | None:
    """The request's compiled grammar (None without a response_format), compiled here unless cached. ValueError
    naming response_format for a schema that cannot be followed or a model without a tokenizer;
    StructuredOutputUnavailable without xgrammar."""
    key = grammar_key(params)
    if key is None:
        return None
    if tokenizer is None:
        raise ValueError("response_format: JSON output needs the model's tokenizer")
    return GRAMMARS.compile(tokenizer, vocab, key)


async def prepare(params: SamplingParams, tokenizer: Tokenizer | None, vocab: int) -> None:
    """`grammar_for` ahead of the request's `new_sequence`, in a thread unless cached, so that an event loop
    never waits on a compile."""
    key = grammar_key(params)
    if key is not None and (tokenizer is None or GRAMMARS.cached(tokenizer, vocab, key) is None):
        await asyncio.to_thread(grammar_for, params, tokenizer, vocab)


class JsonConstraint:
    """One request's grammar state: which tokens may come next, advanced by each chosen token."""

    def __init__(self, grammar: Any, stop_ids: frozenset[int], generated: Sequence[int] = ()) -> None:
        """A matcher over a compiled grammar, advanced over the tokens the request already generated (a decode
        instance continuing a prefill, a request resumed after a fault); ValueError if they break the grammar.
        The grammar may end only on the request's own stop ids; with none (ignore_eos) it ends on completion."""
        xgr = _xgr()
        stops = sorted(stop_ids)
        self.matcher = xgr.GrammarMatcher(
            grammar, override_stop_tokens=stops or None, terminate_without_stop_token=not stops
        )
        for i, token in enumerate(generated):
            if not self.accept(token):
                raise ValueError(f"response_format: generated token {i} ({token}) does not follow the grammar")

    @property
    def done(self) -> bool:
        """Whether the grammar ended (its stop id accepted, or complete with no stop ids to wait for)."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token)


def apply_masks(
    logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[JsonConstraint]
) -> dict[int, torch.Tensor]:
    """Row index -> a copy of that row of fp32 logits [b, vocab] where every token its constraint does not allow
    next is -inf (only the constrained rows are copied)."""
    xgr = _xgr()
    masked = logits[list(rows)].float()
    bitmask = xgr.allocate_token_bitmask(len(rows), masked.shape[1])
    for j, constraint in enumerate(constraints):
        constraint.matcher.fill_next_token_bitmask(bitmask, j)
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    return dict(zip(rows, masked))
