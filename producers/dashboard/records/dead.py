"""Dead letters: reading ``<prefix>:dead`` and re-driving a letter as a new job.

A partitioned layout has a dead-letter stream per partition
(:meth:`~batchd.producers.keys.Keys.dead_streams`): a page merges their newest letters,
and a letter is named ``<partition>/<entry id>`` there (its entry id alone when
unpartitioned), since two streams may hold the same id.

A daemon writes a letter (``id``, ``queue``, ``entry``, ``error``, ``payload``: the
job's JSON, cut at 4096 bytes) when it refuses a job: bad input, poison (delivered too
many times), a per-job failure. Re-driving submits the letter's request again under a
new id on its queue, which the audit trail and ``<prefix>:dashboard:redrives`` link to
the old job. The new id is derived from the letter (``rd-`` + a digest), and the submit
is idempotent: a double click, or two operators at once, make one job, and a letter
shows the job it became. A letter whose payload was cut or does not validate cannot be
re-driven (it would only fail again): the page says why.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchd.config.limits import LimitSettings
from batchd.producers.aio import AsyncClient
from batchd.producers.dashboard.records.names import redrives
from batchd.producers.errors import ValidationError
from batchd.producers.keys import DEFAULT_QUEUE, Keys, is_name
from batchd.producers.schema import parse_job

# The daemon keeps at most this much of a rejected payload in a letter
# (batchd.daemon.worker.publisher.DEAD_PAYLOAD_BYTES; producers cannot import the daemon).
PAYLOAD_CUT_BYTES = 4096


@dataclass(frozen=True)
class DeadLetter:
    """One letter; ``request`` is its payload decoded (None when it is not JSON),
    ``problem`` why it cannot be re-driven (None when it can), ``redrive`` the record of
    the job it was re-driven as."""

    entry: str
    at: float
    job_id: str
    queue: str
    error: str
    payload: bytes
    request: dict[str, Any] | None
    problem: str | None
    redrive: dict[str, Any] | None

    @property
    def payload_text(self) -> str:
        return self.payload.decode(errors="replace")


@dataclass(frozen=True)
class Redriven:
    """What re-driving one letter did: the new job, or why not."""

    entry: str
    job_id: str | None
    error: str | None = None
    before: bool = False


def redrive_id(entry: str, job_id: str) -> str:
    """The id of a letter's re-driven job: the same letter, the same id."""
    return "rd-" + hashlib.sha256(f"{entry}\0{job_id}".encode()).hexdigest()[:24]


def judge(payload: bytes, limits: LimitSettings | None) -> tuple[dict[str, Any] | None, str | None]:
    """The payload as JSON (or None) and why it cannot run again (or None)."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        data = None
    if data is None and len(payload) >= PAYLOAD_CUT_BYTES:
        return None, f"the letter keeps only the first {PAYLOAD_CUT_BYTES} bytes of the job"
    try:
        parse_job(payload, limits)
    except ValidationError as exc:
        return data if isinstance(data, dict) else None, f"the request is invalid: {exc}"
    return data, None


def letter_name(keys: Keys, partition: int, entry_id: str) -> str:
    """How a letter is named (see the module doc)."""
    return entry_id if keys.partitions == 1 else f"{partition}/{entry_id}"


def parse_letter_name(keys: Keys, name: str) -> tuple[int, str] | None:
    """The partition and entry id a letter's name gives; None for anything else."""
    partition, slash, entry_id = name.rpartition("/") if keys.partitions > 1 else ("0", "", name)
    ms, dash, seq = entry_id.partition("-")
    if not (dash and ms.isdigit() and seq.isdigit() and partition.isdigit()):
        return None
    if keys.partitions > 1 and not (slash and int(partition) < keys.partitions):
        return None
    return int(partition), entry_id


async def count_letters(client: aioredis.Redis, keys: Keys) -> int:
    """Letters held, over every partition."""
    async with client.pipeline(transaction=False) as pipe:
        for stream in keys.dead_streams():
            pipe.xlen(stream)
        return sum(await pipe.execute())


async def read_letters(
    client: aioredis.Redis,
    keys: Keys,
    *,
    count: int,
    before: str | None = None,
    limits: LimitSettings | None = None,
) -> list[DeadLetter]:
    """The newest ``count`` letters (older than letter ``before`` when given: in every
    partition, older than its entry id)."""
    after = parse_letter_name(keys, before) if before else None
    top = f"({after[1]}" if after else "+"
    async with client.pipeline(transaction=False) as pipe:
        for stream in keys.dead_streams():
            pipe.xrevrange(stream, max=top, min="-", count=count)
        replies: Any = await pipe.execute()
    found = [
        (_entry_order(entry), letter_name(keys, k, entry.decode()), fields)
        for k, entries in enumerate(replies)
        for entry, fields in entries
    ]
    found = sorted(found, key=lambda item: item[0], reverse=True)[:count]
    if not found:
        return []
    records = await client.hmget(redrives(keys), [f"entry:{name}" for _, name, _ in found])
    return [
        _letter(name, fields, record, limits)
        for (_, name, fields), record in zip(found, records, strict=True)
    ]


async def read_letter(
    client: aioredis.Redis, keys: Keys, entry: str, limits: LimitSettings | None = None
) -> DeadLetter | None:
    """The letter named ``entry``; None when there is none."""
    named = parse_letter_name(keys, entry)
    if named is None:
        return None
    partition, entry_id = named
    stream = keys.dead_stream(partition)
    found: Any = await client.xrange(stream, min=entry_id, max=entry_id, count=1)
    if not found:
        return None
    record = await client.hget(redrives(keys), f"entry:{entry}")
    return _letter(entry, found[0][1], record, limits)


def _entry_order(entry: bytes) -> tuple[int, int]:
    """A stream entry id as numbers, to merge partitions newest first."""
    ms, _, seq = entry.decode().partition("-")
    return int(ms), int(seq)


def _letter(
    entry: str, fields: dict[bytes, bytes], record: Any, limits: LimitSettings | None
) -> DeadLetter:
    text = {k.decode(errors="replace"): v for k, v in fields.items()}
    payload = text.get("payload", b"")
    request, problem = judge(payload, limits)
    return DeadLetter(
        entry=entry,
        at=int(entry.rpartition("/")[2].split("-", 1)[0]) / 1000,
        job_id=text.get("id", b"").decode(errors="replace"),
        queue=text.get("queue", b"").decode(errors="replace"),
        error=text.get("error", b"").decode(errors="replace"),
        payload=payload,
        request=request,
        problem=problem,
        redrive=orjson.loads(record) if record else None,
    )


async def redrive(
    client: AsyncClient, keys: Keys, letter: DeadLetter, *, operator: str, note: str
) -> Redriven:
    """Submit the letter's request again as a new job (see the module doc)."""
    if letter.redrive:
        return Redriven(letter.entry, str(letter.redrive.get("job")), before=True)
    if letter.problem:
        return Redriven(letter.entry, None, letter.problem)
    new_id = redrive_id(letter.entry, letter.job_id)
    request = parse_job(letter.payload, client.limits).model_dump(mode="json", exclude_none=True)
    request["id"] = new_id
    queue = letter.queue if is_name(letter.queue) else DEFAULT_QUEUE
    try:
        await client.submit_request(request, queue=queue, idempotent=True)
    except ValidationError as exc:
        return Redriven(letter.entry, None, str(exc))
    record = orjson.dumps(
        {
            "entry": letter.entry,
            "job": new_id,
            "from": letter.job_id,
            "queue": queue,
            "by": operator,
            "note": note,
            "at": round(time.time(), 3),
        }
    )
    await client.redis.hset(
        redrives(keys), mapping={f"entry:{letter.entry}": record, f"job:{new_id}": record}
    )
    return Redriven(letter.entry, new_id)
