"""An ASGI app (the gateway, the dashboard) served by uvicorn on a thread, for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve_in_thread(config: uvicorn.Config, *, start_timeout_s: float = 20) -> Iterator[str]:
    """Run ``config``'s app until the block ends; yields ``http://<host>:<port>``."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="asgi-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
