"""What the HTTP frontend refuses before a request reaches it (ASGI middleware): oversized bodies and clients
without the API key.

A body is held in memory whole while JSON and pydantic parse it, so a few 10 MB bodies would grow the frontend
by gigabytes before validation could refuse them. `BodyLimit` answers 413 as soon as the declared
`Content-Length`, or the bytes actually received, pass the limit, and passes smaller bodies through unchanged.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: HTTP request bodies larger than `max_bytes` get 413 in OpenAI's error shape.

    The body is read here, at most `max_bytes` of it, and replayed to the app; a larger one is refused without
    reading the rest (and without the app seeing any of it)."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        chunks: list[Message] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                chunks.append(message)
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(send, received)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        replay = iter(chunks)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send, size: int) -> None:
        message = f"request body of {size} bytes or more exceeds the limit of {self.max_bytes} bytes"
        await _send_error(send, 413, message, "request_too_large")


class ApiKey:
    """ASGI middleware: every /v1/ request must carry `Authorization: Bearer KEY` (as vLLM's --api-key), else
    401 in OpenAI's error shape; /health and /metrics stay open to probes."""

    def __init__(self, app: Callable, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                await _send_error(
                    send, 401, "invalid or missing API key (Authorization: Bearer ...)", "invalid_api_key"
                )
                return
        await self.app(scope, receive, send)


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
