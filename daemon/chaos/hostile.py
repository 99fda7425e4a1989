"""Seeded hostile queue entries: what a buggy or malicious producer can XADD.

Random bytes, broken and deeply nested JSON, non-finite and huge numbers,
wrong types, ids that try to reach other keys (``:``, ``*``, newlines) or that
name real jobs of the run, and entries without a job field. Every one is
checked to be invalid with the producers' own parser, so each must end up
dead-lettered, never run and never touching the job it names.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import orjson

from batchd.producers.errors import ValidationError
from batchd.producers.keys import JOB_FIELD
from batchd.producers.schema import parse_job

NASTY_IDS = ["a:events", "*", "..", "x\n", "", "é" * 300, "a{b}c", "q:queue:default"]


def _random_bytes(rng: random.Random, ids: Sequence[str]) -> bytes:
    return rng.randbytes(rng.randint(0, 300))


def _deep(rng: random.Random, ids: Sequence[str]) -> bytes:
    depth = rng.randint(100, 5000)
    return b"[" * depth + b"]" * depth


def _non_finite(rng: random.Random, ids: Sequence[str]) -> bytes:
    field = rng.choice(["temperature", "top_p", "priority", "max_tokens"])
    value = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", str(2**200)])
    return f'{{"prompt": "x", "{field}": {value}}}'.encode()


def _wrong_types(rng: random.Random, ids: Sequence[str]) -> bytes:
    job: dict[str, object] = {
        "id": rng.choice(ids),
        "prompt": rng.choice([5, None, [], {"a": 1}, True]),
    }
    return orjson.dumps(job)


def _bad_values(rng: random.Random, ids: Sequence[str]) -> bytes:
    job = {
        "id": rng.choice(ids),
        "prompt_token_ids": rng.choice([[], [-1], ["a"], [2**40]]),
        "max_tokens": rng.choice([0, -5, 10**9]),
    }
    return orjson.dumps(job)


def _nasty_id(rng: random.Random, ids: Sequence[str]) -> bytes:
    return orjson.dumps({"id": rng.choice(NASTY_IDS), "prompt": "hi"})


def _truncated(rng: random.Random, ids: Sequence[str]) -> bytes:
    whole = orjson.dumps({"id": rng.choice(ids), "prompt": "hello there", "max_tokens": 4})
    return whole[: rng.randint(1, len(whole) - 1)]


KINDS: list[Callable[[random.Random, Sequence[str]], bytes]] = [
    _random_bytes,
    _deep,
    _non_finite,
    _wrong_types,
    _bad_values,
    _nasty_id,
    _truncated,
]


class HostileSource:
    """Draws invalid queue entries (field -> value). Ids of real jobs are drawn from jobs
    that finished moments ago: an entry naming a job not yet created, or one whose results
    expired, would be a new job of that id, not an attack on an existing one."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed ^ 0x5EED)

    def entry(self, finished_ids: Sequence[str]) -> dict[str, bytes]:
        ids = list(finished_ids[-50:]) or NASTY_IDS
        while True:
            payload = self.rng.choice(KINDS)(self.rng, ids)
            field = JOB_FIELD if self.rng.random() < 0.9 else "payload"
            if field != JOB_FIELD or not _valid(payload):
                return {field: payload}


def _valid(payload: bytes) -> bool:
    try:
        parse_job(payload)
    except ValidationError:
        return False
    return True
