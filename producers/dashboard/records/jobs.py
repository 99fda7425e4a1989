"""One job as its page shows it: status, request, timings, usage, and its text so far.

Redis holds a job's request only in its queue entry, which is trimmed once the job is
acked: the page shows the request of a queued or running job (found through the
``entry`` its status names, or, for a job no daemon has picked up yet, in the entries
added around its ``queued_at``), and says so for an ended one, whose metadata, usage
and timings its final event still carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchd.producers.dashboard.records.names import redrives
from batchd.producers.keys import EVENT_FIELD, JOB_FIELD, Keys, is_name
from batchd.producers.schema import Event

# The most events a page replays (a longer job shows its final text once it ends).
MAX_REPLAY = 100_000
# Around a queued job's queued_at (client clock vs Redis clock), and how many entries
# of that window are read at most, to find its request.
WINDOW_S = 30.0
WINDOW_ENTRIES = 10_000
PAGE = 1000
TIMESTAMPS = (
    ("queued", "queued_at"),
    ("started", "started_at"),
    ("first token", "first_token_at"),
    ("finished", "finished_at"),
)


@dataclass
class JobPage:
    """A job's page. ``texts``: each sequence's text so far (0 for n=1), ``last_seq``
    the seq the page has shown (-1: none), ``request`` its JobRequest JSON when Redis
    still holds it (``request_note`` says why not)."""

    job_id: str
    status: dict[str, str]
    texts: dict[int, str] = field(default_factory=dict)
    last_seq: int = -1
    final: Event | None = None
    request: dict[str, Any] | None = None
    request_note: str = ""
    redrive: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        return self.status.get("state") or ("finished" if self.final else "unknown")

    @property
    def ended(self) -> bool:
        return self.final is not None or self.state in (
            "finished",
            "failed",
            "cancelled",
            "expired",
        )

    def time(self, name: str) -> float | None:
        try:
            return float(self.status[name])
        except (KeyError, ValueError):
            return None

    def history(self) -> list[tuple[str, float]]:
        """The job's life as (what, when), in order."""
        steps = [(label, self.time(name)) for label, name in TIMESTAMPS]
        return [(label, at) for label, at in steps if at is not None]

    def spans(self) -> dict[str, float | None]:
        """Waiting, time to first token, generating, and its tokens/s."""
        queued, started = self.time("queued_at"), self.time("started_at")
        first, finished = self.time("first_token_at"), self.time("finished_at")
        tokens = self.completion_tokens
        generating = finished - started if finished and started else None
        return {
            "waited": started - queued if started and queued else None,
            "ttft": first - queued if first and queued else None,
            "generating": generating,
            "tokens_per_s": tokens / generating if tokens and generating else None,
        }

    @property
    def completion_tokens(self) -> int | None:
        if self.final is not None and self.final.usage is not None:
            return self.final.usage.completion_tokens
        raw = self.status.get("completion_tokens")
        return int(raw) if raw and raw.isdigit() else None

    @property
    def metadata(self) -> dict[str, Any] | None:
        if self.final is not None and self.final.metadata:
            return self.final.metadata
        meta = (self.request or {}).get("metadata")
        return meta if isinstance(meta, dict) else None


async def load_job(client: aioredis.Redis, keys: Keys, job_id: str) -> JobPage | None:
    """The job's page now; None when Redis knows nothing of the id."""
    if not is_name(job_id):
        return None
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.job(job_id))
        pipe.xrange(keys.events(job_id), count=MAX_REPLAY)
        pipe.hget(redrives(keys), f"job:{job_id}")
        raw, entries, record = await pipe.execute()
    if not raw and not entries:
        return None
    page = JobPage(job_id, _decode(raw), redrive=orjson.loads(record) if record else None)
    for _, fields in entries:
        page_take(page, Event.decode(fields[EVENT_FIELD.encode()]))
    page.request, page.request_note = await find_request(client, keys, page)
    return page


async def load_status(client: aioredis.Redis, keys: Keys, job_id: str) -> JobPage:
    """The job's status alone (what a live page refreshes every second)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.job(job_id))
        pipe.hget(redrives(keys), f"job:{job_id}")
        raw, record = await pipe.execute()
    return JobPage(job_id, _decode(raw), redrive=orjson.loads(record) if record else None)


def page_take(page: JobPage, event: Event) -> None:
    """Add one event to the page's texts (the final event's texts replace them)."""
    page.last_seq = event.seq
    if event.final:
        page.final = event
        if event.choices:
            page.texts = {c.index: c.text for c in event.choices}
        else:
            page.texts = {0: event.text}
    else:
        index = event.index or 0
        page.texts[index] = page.texts.get(index, "") + event.text


async def find_request(
    client: aioredis.Redis, keys: Keys, page: JobPage
) -> tuple[dict[str, Any] | None, str]:
    """The job's request from its queue entry, or why there is none."""
    queue, entry = page.status.get("queue"), page.status.get("entry")
    if not queue or not is_name(queue):
        return None, "the job names no queue"
    stream = keys.queue_for(queue, page.job_id)
    if entry:
        found: Any = await client.xrange(stream, min=entry, max=entry, count=1)
        payload = found[0][1].get(JOB_FIELD.encode()) if found else None
    elif page.state == "queued" and page.time("queued_at") is not None:
        payload = await _search_window(client, stream, page.job_id, page.time("queued_at") or 0)
    else:
        payload = None
    if payload is None:
        return None, (
            "Redis no longer holds the request: a queue entry is trimmed once its job is acked"
        )
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, "the queue entry does not hold JSON"
    return (data, "") if isinstance(data, dict) else (None, "the queue entry is not an object")


async def _search_window(
    client: aioredis.Redis, stream: str, job_id: str, queued_at: float
) -> bytes | None:
    """The payload naming ``job_id`` among the entries added around ``queued_at``."""
    needle = b'"id":"' + job_id.encode() + b'"'
    low = f"{int((queued_at - WINDOW_S) * 1000)}-0"
    high = f"{int((queued_at + WINDOW_S) * 1000)}-0"
    read = 0
    while read < WINDOW_ENTRIES:
        entries: Any = await client.xrange(stream, min=low, max=high, count=PAGE)
        for _, fields in entries:
            payload = fields.get(JOB_FIELD.encode(), b"")
            if needle in payload.replace(b'": "', b'":"'):
                return bytes(payload)
        if len(entries) < PAGE:
            return None
        read += len(entries)
        low = "(" + entries[-1][0].decode()
    return None


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
