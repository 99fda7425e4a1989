"""Server-Sent Events: the wire format, and the response that carries a stream of them.

SSE rather than WebSocket: the page only listens, EventSource reconnects by itself
(sending ``Last-Event-ID``, which a job stream uses to resume after the last seq it
delivered), and it passes through any HTTP proxy. Each event's data is one line of
JSON; a comment every ``KEEPALIVE_S`` keeps idle proxies from closing the stream and
lets the server notice a browser that left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse

KEEPALIVE_S = 15.0
KEEPALIVE = ": keepalive\n\n"
# How long a browser waits before reconnecting a dropped stream (ms).
RETRY_MS = 2000


def event(name: str, data: Any, *, event_id: int | None = None) -> str:
    """One SSE message: ``data`` as a line of JSON (JSON never holds a raw newline)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {orjson.dumps(data).decode()}\n\n"


def stream(events: AsyncIterator[str]) -> StreamingResponse:
    """A response streaming ``events`` (texts made by :func:`event`), uncached and
    unbuffered by proxies."""

    async def body() -> AsyncIterator[str]:
        yield f"retry: {RETRY_MS}\n\n"
        async for text in events:
            yield text

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
