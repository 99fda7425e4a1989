"""TTFT and inter-token latency, measured from what the daemons already publish.

Every job's final event carries its ``timings`` (queued, started, first token,
finished) and ``usage``; it is PUBLISHed on the job's token channel like every token.
The collector PSUBSCRIBEs to ``<prefix>:job:*:tokens``, skips token events with a byte
test (no JSON parse), and keeps, per finished job, its time to first token and its mean
inter-token latency ((finished - first token) / (completion tokens - 1)). Percentiles
are over the jobs that finished in the last ``window_s``; failures are kept for the
"recent errors" list. Pub/Sub is at-most-once: this is a sample, not a ledger (a
dashboard that is down or slow misses jobs; Redis disconnects a subscriber that falls
far behind, and the collector then subscribes again). On a partitioned layout the
pattern is ``<prefix>:{*}:job:*:tokens``; on Redis Cluster, whose sharded channels have
no pattern subscription, the dashboard does not run the collector (and says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from pydantic import ValidationError

from batchd.producers.dashboard.fleet.history import percentile
from batchd.producers.keys import Keys
from batchd.producers.schema import Event, FinishReason

log = logging.getLogger(__name__)

SAMPLES = 20_000
FAILURES = 20


@dataclass(frozen=True)
class Finished:
    """One job's end as its final event tells it."""

    at: float
    job_id: str
    ttft_s: float | None
    itl_s: float | None
    tokens: int
    error: str | None


@dataclass(frozen=True)
class Latency:
    """Percentiles over a window; None where no job gave a figure."""

    jobs: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None


def finished_from(job_id: str, event: Event, at: float) -> Finished | None:
    """What a final event says of its job; None for a token event."""
    if not event.final:
        return None
    t, usage = event.timings, event.usage
    ttft = itl = None
    if t is not None and t.queued is not None and t.first_token is not None:
        ttft = max(0.0, t.first_token - t.queued)
    tokens = usage.completion_tokens if usage is not None else 0
    if t is not None and t.first_token is not None and t.finished is not None and tokens > 1:
        itl = max(0.0, t.finished - t.first_token) / (tokens - 1)
    failed = event.finish_reason is FinishReason.error
    return Finished(at, job_id, ttft, itl, tokens, (event.error or "error") if failed else None)


class LatencyCollector:
    """The recent finished jobs of the whole fleet (see the module doc)."""

    def __init__(self, keys: Keys, *, window_s: float = 60.0) -> None:
        self.keys = keys
        self.window_s = window_s
        self.finished: deque[Finished] = deque(maxlen=SAMPLES)
        self.failures: deque[Finished] = deque(maxlen=FAILURES)

    def take(self, channel: bytes, data: bytes, *, at: float | None = None) -> None:
        """One message of the pattern subscription."""
        if b'"finish_reason"' not in data:
            return  # a token event: the common case, decided without parsing
        # ``...:job:<id>:tokens``, whatever the partition's tag (an id holds no ``:``).
        job_id = channel.decode(errors="replace").rpartition(":job:")[2]
        job_id = job_id.removesuffix(":tokens")
        try:
            done = finished_from(job_id, Event.decode(data), time.time() if at is None else at)
        except (ValueError, ValidationError):
            return
        if done is not None:
            self.finished.append(done)
            if done.error is not None:
                self.failures.append(done)

    def latency(self, now: float | None = None) -> Latency:
        since = (time.time() if now is None else now) - self.window_s
        recent = [f for f in reversed(self.finished) if f.at >= since]
        ttft = [f.ttft_s for f in recent if f.ttft_s is not None]
        itl = [f.itl_s for f in recent if f.itl_s is not None]
        return Latency(
            len(recent),
            percentile(ttft, 50),
            percentile(ttft, 95),
            percentile(itl, 50),
            percentile(itl, 95),
        )

    async def run(self, client: aioredis.Redis, *, retry_s: float = 2.0) -> None:
        """Listen until cancelled; a lost connection is logged and subscribed again."""
        while True:
            pubsub: Any = client.pubsub(ignore_subscribe_messages=True)
            pattern = self.keys.tokens_pattern
            try:
                await pubsub.psubscribe(pattern)
                while pattern == self.keys.tokens_pattern:  # a new layout: subscribe anew
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self.take(message["channel"], message["data"])
            except (redis.RedisError, OSError) as exc:
                log.warning("latency listener: %s; subscribing again", type(exc).__name__)
                await asyncio.sleep(retry_s)
            finally:
                await pubsub.aclose()
