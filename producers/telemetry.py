"""How every batchd process reports itself: log lines (text or JSON) and a Prometheus endpoint.

Shared by the daemon, the bulk worker and any producer-side service (a gateway):
nothing here needs MLX. JSON lines carry the log record's message plus its
structured fields (``event``, ``job_id``, timings, usage...) given with
``extra=``; a message written as ``"job %s ..."`` gets its first argument as
``job_id`` too, so existing log calls are searchable by job without change.
Credentials in URLs (``redis://user:secret@host``) are masked in both formats.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from typing import IO, Any

import orjson

from batchd.config.secrets import redact

LOG_FORMATS = ("text", "json")
# The loggers of the ASGI server a gateway runs in: written through batchd's handlers.
SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class RedactingFormatter(logging.Formatter):
    """The usual text format, with URL passwords masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC ISO 8601), level, logger, msg, and the fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        job_id = _job_of(record)
        if job_id is not None:
            body["job_id"] = job_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in body:
                body[key] = value
        if record.exc_info:
            body["exc"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(body, default=str).decode()


def _job_of(record: logging.LogRecord) -> str | None:
    explicit = getattr(record, "job_id", None)
    if explicit is not None:
        return str(explicit)
    if isinstance(record.msg, str) and record.msg.startswith("job %s") and record.args:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return str(args[0])
    return None


def configure_logging(level: str, log_format: str, *, stream: IO[str] | None = None) -> None:
    """Root logging to ``stream`` (stderr) in ``log_format`` (``text`` or ``json``)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: one of {LOG_FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else RedactingFormatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)


class AccessFields(logging.Filter):
    """Gives uvicorn's access lines (``'%s - "%s %s HTTP/%s" %d'`` of client, method,
    path, HTTP version, status) structured fields: ``event`` ``http_request``,
    ``client``, ``method``, ``path``, ``status``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            client, method, path, _, status = args
            record.event = "http_request"
            record.client, record.method, record.path, record.status = client, method, path, status
        return True


def route_server_logs(*, access_log: bool = True) -> None:
    """uvicorn's log lines through the root handlers (:func:`configure_logging`'s format):
    its own handlers are dropped, access lines get :class:`AccessFields`, and
    ``access_log=False`` silences them."""
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessFields) for f in access.filters):
        access.addFilter(AccessFields())
    access.disabled = not access_log


def serve_metrics(port: int, *, addr: str, registry: Any) -> None:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread.

    Raises OSError when the port is taken (the caller says which option to change).
    """
    from prometheus_client import start_http_server

    start_http_server(port, addr=addr, registry=registry)
    logging.getLogger(__name__).info(
        "metrics at http://%s:%d/metrics",
        addr,
        port,
        extra={"event": "metrics_listening", "port": port},
    )
