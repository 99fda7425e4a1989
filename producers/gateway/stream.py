"""An SSE response that cancels its job when the client goes away.

Starlette's StreamingResponse notices a disconnect only when a send fails
(ASGI 2.4), which may be minutes away for a job still queued. This response
listens for ``http.disconnect`` while it streams, stops at once, and calls
``on_gone`` outside the cancelled scope, so the cancel itself is never cut short.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
# An SSE comment: keeps proxies from closing a stream whose job waits in the queue.
KEEPALIVE = b": keep-alive\n\n"


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class EventStream(Response):
    """``text/event-stream`` of ``chunks``; ``finished()`` says whether the job ended, and
    ``on_gone`` runs when the stream stopped before it did; ``on_close`` runs always."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        finished: Callable[[], bool],
        on_gone: Callable[[], Awaitable[None]],
        on_close: Callable[[], None],
    ) -> None:
        # No body attribute: Response would declare a Content-Length (0) for it.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.chunks = chunks
        self.finished = finished
        self.on_gone = on_gone
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    async for chunk in self.chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client is gone mid-send
                    pass
                group.cancel_scope.cancel()
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await _close(self.chunks)
                    if not self.finished():
                        await self.on_gone()
            finally:
                self.on_close()


async def _close(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
