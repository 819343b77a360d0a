"""What every connection and request passes before the API (:mod:`.app`) sees it.

- :class:`Guard`, an ASGI middleware in front of FastAPI: with an API key, a request without it gets
  401 before a byte of its body is read or parsed (only ``/health`` is open); a body over its
  route's limit gets 413, at once from ``Content-Length``, or as it streams (chunked) the moment it
  passes the limit; a body that stops arriving for ``body_timeout`` seconds gets 408. Nothing past
  the limit is buffered, parsed or spooled to disk.
- :func:`guarded_protocol`, uvicorn's h11 protocol with what uvicorn lacks: a header timeout (a
  connection that has not sent a whole request head within ``header_timeout`` seconds is closed
  with 408) and a cap on open connections, where a new one closes the oldest connection that is
  not running a request (half-sent or idle), so slow clients cannot lock others out.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, Awaitable, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["OPEN_PATHS", "Guard", "guarded_protocol"]

OPEN_PATHS = ("/health",)  # what answers without the API key
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Refused(Exception):
    """The body broke its limit or its timeout; the guard answers instead of the app."""


async def _answer(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": message, "detail": message}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the key first, then the body's size and pace (see the module doc).
    ``body_limit(path)``: the most bytes a body to ``path`` may have."""

    def __init__(self, app: Any, api_key: str | None, body_limit: Callable[[str], int], body_timeout: float) -> None:
        self.app = app
        self.key = None if api_key is None else f"Bearer {api_key}".encode("ascii")
        self.body_limit, self.body_timeout = body_limit, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.key is not None and path not in OPEN_PATHS and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.key):
            return await _answer(send, 401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                                 {"WWW-Authenticate": "Bearer"})
        limit = self.body_limit(path)
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            return await _answer(send, 413, _too_large(path, limit))
        state = {"size": 0, "done": False, "fault": None, "started": False}

        async def guarded_receive() -> dict[str, Any]:
            if state["done"]:  # the body is in: what follows is the wait for a disconnect, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                state["fault"] = (408, f"the request body stopped arriving for {self.body_timeout:g} s; send it "
                                       "at once")
                raise _Refused() from None
            if message["type"] == "http.request":
                state["size"] += len(message.get("body", b""))
                if state["size"] > limit:
                    state["fault"] = (413, _too_large(path, limit))
                    raise _Refused()
                state["done"] = not message.get("more_body", False)
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if state["fault"] is not None:  # the app's own answer to the broken body (a 400 or 500) is dropped
                return
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if state["fault"] is None:
                raise
        if state["fault"] is not None and not state["started"]:
            await _answer(send, *state["fault"])


def _too_large(path: str, limit: int) -> str:
    return (f"the request body is over the {limit:,}-byte limit of {path} (set by --max-image-mb and --max-images); "
            "send a smaller one")


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout and a connection cap (see the module doc)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened = time.monotonic()
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()
            if len(self.connections) > max_connections:  # make room: the oldest one not running a request
                waiting = [c for c in self.connections if c is not self and getattr(c, "_waiting", lambda: False)()]
                victim = min(waiting, key=lambda c: c._opened) if waiting else self
                victim._close(503, "Service Unavailable")

        def _waiting(self) -> bool:
            """True while no request is running here: before a request head is complete, or between requests."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            if self._waiting():  # a request head begins (or goes on): it must be whole in time
                self._arm()
            super().data_received(data)
            if not self._waiting():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # idle now: uvicorn's keep-alive timeout closes it
            self._disarm()

        def _head_late(self) -> None:
            self._head_timer = None
            if self._waiting():
                self._close(408, "Request Timeout")

        def _close(self, status: int, phrase: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                if self.cycle is None:  # a first request, cut off; an idle keep-alive connection closes quietly
                    self.transport.write(f"HTTP/1.1 {status} {phrase}\r\ncontent-length: 0\r\nconnection: close"
                                         "\r\n\r\n".encode())
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
