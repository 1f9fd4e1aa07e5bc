"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole and streamed, with logprobs.

Responses are plain dicts in the field order OpenAI uses. A logprob is the model's own (raw) log-probability;
one that is -inf or NaN is sent as -9999.0, as vLLM does, because JSON has no infinities. A token's text in
logprobs is that token decoded alone (special tokens included); `bytes` are its UTF-8 bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from aiollm.model.logprobs import TokenLogprobs

# what JSON carries for a log-probability of -inf (or NaN)
FLOOR = -9999.0

# a token id -> its text alone
TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, request_id: str, model: str, choices: list[dict], use: dict | None = None) -> dict:
    """The envelope every response and streamed chunk shares; `usage` only where given."""
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs], offsets: Sequence[int], text: TokenText
) -> dict:
    """The legacy completions shape: per token its text, logprob, the top alternatives (a dict that also holds
    the sampled token, as OpenAI's does) and the offset of its text in the completion."""
    tops = []
    for token, entry in zip(token_ids, entries):
        top = {text(t): _lp(lp) for t, lp in entry.top}
        top.setdefault(text(token), _lp(entry.logprob))
        tops.append(top)
    return {
        "tokens": [text(t) for t in token_ids],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": list(offsets),
    }


def _token_entry(token: int, logprob: float, text: TokenText) -> dict:
    s = text(token)
    return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs], text: TokenText) -> dict:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]}."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _token_entry(token, entry.logprob, text)
        item["top_logprobs"] = [_token_entry(t, lp, text) for t, lp in entry.top]
        content.append(item)
    return {"content": content}
