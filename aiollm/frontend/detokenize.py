"""Incremental detokenisation with stop strings, for streaming text out of token deltas.

Why not decode each token alone: byte-level BPE splits multi-byte characters across tokens and
merges spaces into the next token, so a token's text depends on its neighbours. We decode the
whole completion each time and emit only the new, settled suffix: text ending in an incomplete
character (U+FFFD) is held back, and so is any tail that could still become a stop string, so a
stream never shows a client part of a stop sequence (the whole one ends the text when it is to be
included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


class IncrementalText:
    """Accumulates token ids and yields the newly settled text."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self._decode = decode
        self._stops = [s for s in stops if s]
        # keep the stop string that ended the text at its end (vLLM's include_stop_str_in_output)
        self._include_stop = include_stop
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self.stopped = False  # a stop string was found; the text ends before it
        self.text = ""  # the settled text so far (what was returned, in total)

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to show (may be empty)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        full = self._decode(self._ids)
        hits = [(full.find(stop, max(0, self._emitted - len(stop) + 1)), stop) for stop in self._stops]
        hits = [(at, stop) for at, stop in hits if at != -1]
        if hits:
            at, stop = min(hits)
            full = full[: at + len(stop) if self._include_stop else at]
            self.stopped = True
        if not self.stopped:
            full = self._settled(full)
        return self._advance(full)

    def flush(self) -> str:
        """At the end of generation: return whatever was held back (never part of a found stop)."""
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        return self._advance(full)

    def _settled(self, full: str) -> str:
        end = len(full)
        while end > self._emitted and full[end - 1] == _INCOMPLETE:
            end -= 1
        hold = 0  # the longest tail that is a prefix of some stop string
        for stop in self._stops:
            for k in range(min(len(stop) - 1, end - self._emitted), hold, -1):
                if full[end - k : end] == stop[:k]:
                    hold = k
                    break
        return full[: end - hold]

    def _advance(self, full: str) -> str:
        new = full[self._emitted :]
        if not new:
            return ""
        self._emitted = len(full)
        self.text += new
        return new
