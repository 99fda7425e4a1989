"""How the gateway listens: uvicorn with bounds on slow clients and on connections.

uvicorn bounds an idle keep-alive connection but not one that is slow to send its
headers: a client trickling a byte at a time holds its connection (and, h11 re-scanning
the buffer on every byte, some CPU) for as long as it likes. :class:`HeaderTimeoutH11`
closes a connection whose request headers are not complete ``header_timeout_s`` after it
opened or after its previous answer, with a 408. ``max_connections`` (uvicorn's
``limit_concurrency``) answers 503 at once past that many connections and requests, and
``listen_backlog`` is the kernel's accept queue. uvicorn's own logging setup is skipped:
its loggers write through batchd's handlers, in ``log_format``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from batchd.config.sections import GatewaySettings
from batchd.producers.telemetry import route_server_logs

log = logging.getLogger(__name__)
# Descriptors beyond the connections: Redis pools, log files, the interpreter's own.
SPARE_FILES = 256
_LATE = b"request headers not sent in time"
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_LATE), _LATE)
)


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers are late."""

    header_timeout_s: float = GatewaySettings().header_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE until a whole request head has been parsed.
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's headers have the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # no answer started on this connection
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def raise_open_files(settings: GatewaySettings) -> int:
    """Raise the soft limit of open files towards the hard one, so that
    ``max_connections`` sockets fit; the limit now (a warning when it is still short)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = settings.max_connections + settings.redis_max_connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "open files limited to %d: fewer than gateway.max_connections (%d) clients fit; "
            "raise the hard limit (LimitNOFILE= in the unit, ulimit -Hn)",
            soft,
            settings.max_connections,
        )
    return int(soft)


def uvicorn_options(settings: GatewaySettings, *, log_level: str = "info") -> dict[str, Any]:
    """uvicorn's options (``uvicorn.run(app, **options)``) for ``settings``' bounds; its
    log lines go through batchd's logging, which must be configured already."""
    protocol = type(
        "GatewayH11", (HeaderTimeoutH11,), {"header_timeout_s": settings.header_timeout_s}
    )
    route_server_logs(access_log=settings.access_log)
    return {
        "host": settings.host,
        "port": settings.port,
        "http": protocol,
        "ws": "none",
        "lifespan": "on",
        "log_config": None,
        "log_level": log_level.lower(),
        "access_log": settings.access_log,
        "limit_concurrency": settings.max_connections,
        "backlog": settings.listen_backlog,
        "timeout_keep_alive": settings.keep_alive_s,
        "timeout_graceful_shutdown": int(settings.shutdown_grace_s) or None,
        "server_header": False,
    }


def uvicorn_config(
    app: Any, settings: GatewaySettings, *, log_level: str = "info"
) -> uvicorn.Config:
    """The uvicorn configuration of a gateway app (see :func:`uvicorn_options`)."""
    return uvicorn.Config(app, **uvicorn_options(settings, log_level=log_level))
