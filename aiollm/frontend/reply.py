"""A generation's pieces -> OpenAI's whole response, or its stream of chunks (one per generated token).

Choices are numbered by `index`; a streamed chunk carries one choice's piece, so the chunks of `n`
choices interleave as their tokens arrive. With `echo` (completions) the prompt's text comes first:
in the whole response before the completion, in a stream with each choice's first chunk.
"""

from __future__ import annotations

from collections import defaultdict

from aiollm.frontend import responses as out
from aiollm.frontend.generation import Piece


class Reply:
    """Builds the response bodies of one request."""

    def __init__(
        self, request_id: str, model: str, chat: bool, top_n: int | None, echo: str, token_text: out.TokenText
    ) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        # None: no logprobs; else the alternatives each token reports
        self.top_n = top_n
        self.echo = echo
        self.token_text = token_text
        self._pieces: dict[int, list[Piece]] = defaultdict(list)
        self._opened: set[int] = set()

    @property
    def _kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def add(self, piece: Piece) -> None:
        self._pieces[piece.index].append(piece)

    def whole(self, use: dict) -> dict:
        """The non-streamed response, after every piece was added."""
        choices = []
        for index in sorted(self._pieces):
            pieces = self._pieces[index]
            text = "".join(p.text for p in pieces)
            logprobs = self._logprobs(pieces)
            if self.chat:
                choices.append(out.chat_choice(index, text, pieces[-1].finish, logprobs))
            else:
                choices.append(out.text_choice(index, self.echo + text, pieces[-1].finish, logprobs))
        return out.envelope(self._kind, self.request_id, self.model, choices, use)

    def opening(self, n: int) -> list[dict]:
        """The chunks before any token: chat announces the assistant's role for every choice."""
        if not self.chat:
            return []
        return [
            out.envelope(
                self._chunk_kind,
                self.request_id,
                self.model,
                [out.chat_delta(i, {"role": "assistant", "content": ""}, None)],
            )
            for i in range(n)
        ]

    def chunk(self, piece: Piece) -> dict:
        """One streamed chunk: one choice's piece."""
        logprobs = self._logprobs([piece])
        if self.chat:
            choice = out.chat_delta(piece.index, {"content": piece.text}, piece.finish, logprobs)
        else:
            text = piece.text
            if piece.index not in self._opened:
                self._opened.add(piece.index)
                text = self.echo + text
            choice = out.text_choice(piece.index, text, piece.finish, logprobs)
        return out.envelope(self._chunk_kind, self.request_id, self.model, [choice])

    def usage_chunk(self, use: dict) -> dict:
        return out.envelope(self._chunk_kind, self.request_id, self.model, [], use)

    def _logprobs(self, pieces: list[Piece]) -> dict | None:
        if self.top_n is None:
            return None
        scored = [p for p in pieces if p.token is not None and p.logprobs is not None]
        tokens, entries = [p.token for p in scored], [p.logprobs for p in scored]
        if self.chat:
            return out.chat_logprobs(tokens, entries, self.token_text)
        return out.completion_logprobs(tokens, entries, [p.offset for p in scored], self.token_text)
