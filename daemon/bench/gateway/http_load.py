"""A bounded HTTP load client for the gateway: raw asyncio sockets, 127.0.0.1 only.

``batchd bench --workload gateway`` and the gateway's load tests send their requests
with it. httpx or the openai client cost a few milliseconds of CPU per request, which
on a 2-core host would measure the client, not the gateway. This speaks just enough
HTTP/1.1: one request per connection (``Connection: close``), a JSON body, a
Content-Length or chunked answer, and for SSE it counts the token chunks and checks
the stream ends with ``[DONE]``. Every run is bounded: a fixed number of requests,
each with a timeout.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

LOOPBACK = "127.0.0.1"


@dataclass
class Outcome:
    """One request: its status (0: no answer), latency, time to its first SSE token and,
    for a stream, how many token chunks came and whether it ended with [DONE]."""

    status: int
    latency_s: float
    first_token_s: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    done: bool = False
    error: str | None = None
    body: bytes = b""


@dataclass
class Report:
    """Every outcome of one run and its wall time; :meth:`summary` is what a report shows."""

    outcomes: list[Outcome]
    wall_s: float
    statuses: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.statuses = Counter(o.status for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        """Requests, statuses, requests/s and latency quantiles of the 200s (ms), and the
        three most common client-side errors."""
        ok = [o for o in self.outcomes if o.status == 200]
        latencies = sorted(o.latency_s for o in ok)
        firsts = sorted(o.first_token_s for o in ok if o.first_token_s is not None)
        return {
            "requests": len(self.outcomes),
            "statuses": dict(sorted(self.statuses.items())),
            "wall_s": round(self.wall_s, 2),
            "requests_per_s": round(len(ok) / self.wall_s, 1) if self.wall_s else 0.0,
            "p50_ms": _ms(_quantile(latencies, 0.5)),
            "p99_ms": _ms(_quantile(latencies, 0.99)),
            "ttft_p50_ms": _ms(_quantile(firsts, 0.5)),
            "ttft_p99_ms": _ms(_quantile(firsts, 0.99)),
            "errors": Counter(o.error for o in self.outcomes if o.error).most_common(3),
        }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, round(q * 100) - 1)]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


async def request(
    port: int,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    method: str = "POST",
    key: str | None = None,
    timeout_s: float = 60.0,
) -> Outcome:
    """One request to 127.0.0.1:``port``; never raises (a failure is status 0)."""
    started = time.monotonic()
    try:
        return await asyncio.wait_for(_exchange(port, path, body, method, key, started), timeout_s)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        return Outcome(0, time.monotonic() - started, error=type(exc).__name__)


async def _exchange(
    port: int,
    path: str,
    body: dict[str, Any] | None,
    method: str,
    key: str | None,
    started: float,
) -> Outcome:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        payload = orjson.dumps(body) if body is not None else b""
        head = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}", "Connection: close"]
        if key:
            head.append(f"Authorization: Bearer {key}")
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        outcome = Outcome(status, 0.0)
        if "text/event-stream" in headers.get("content-type", ""):
            await _read_events(reader, headers, outcome, started)
        else:
            outcome.body = await _read_body(reader, headers)
        outcome.latency_s = time.monotonic() - started
        return outcome
    finally:
        writer.close()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        async for chunk in _chunks(reader):
            parts.append(chunk)
        return b"".join(parts)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


async def _chunks(reader: asyncio.StreamReader) -> Any:
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def _read_events(
    reader: asyncio.StreamReader, headers: dict[str, str], outcome: Outcome, started: float
) -> None:
    buffer = b""
    source = (
        _chunks(reader)
        if headers.get("transfer-encoding", "").lower() == "chunked"
        else _raw(reader)
    )
    async for data in source:
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue  # a comment (keep-alive)
            data_part = event[6:]
            if data_part == b"[DONE]":
                outcome.done = True
                continue
            chunk = orjson.loads(data_part)
            if "error" in chunk:
                outcome.error = str(chunk["error"].get("code"))
                continue
            _count(chunk, outcome, started)


def _count(chunk: dict[str, Any], outcome: Outcome, started: float) -> None:
    """A token chunk of chat or text completions counts one token; the usage chunk gives
    the completion tokens; Responses API deltas count too."""
    if chunk.get("usage"):
        outcome.usage_tokens = chunk["usage"].get("completion_tokens")
    choices = chunk.get("choices") or []
    token = any(c.get("finish_reason") is None for c in choices)
    if chunk.get("type") == "response.output_text.delta":
        token = True
    if token:
        outcome.tokens += 1
        if outcome.first_token_s is None:
            outcome.first_token_s = time.monotonic() - started


async def _raw(reader: asyncio.StreamReader) -> Any:
    while data := await reader.read(65536):
        yield data


async def run(
    port: int,
    path: str,
    bodies: list[dict[str, Any]],
    *,
    concurrency: int,
    key: str | None = None,
    timeout_s: float = 120.0,
) -> Report:
    """Send every body, at most ``concurrency`` in flight; all of them at once when
    ``concurrency`` >= len(bodies)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> Outcome:
        async with gate:
            return await request(port, path, body, key=key, timeout_s=timeout_s)

    started = time.monotonic()
    outcomes = await asyncio.gather(*(one(b) for b in bodies))
    return Report(list(outcomes), time.monotonic() - started)
