"""An error while the daemon handles one job fails that job alone.

A real Worker on a real redis-server runs normal jobs next to jobs made to
raise at each stage: parsing, admitting, taking the engine's output, and
encoding/publishing its events. Each raising job ends with one final error
event naming the stage and a dead letter; every other job finishes with the
right tokens; nothing is left pending; the daemon keeps serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from batchd.daemon.worker import pickup
from batchd.daemon.worker.generator import JobStart
from batchd.engine.outputs import FinishReason as EngineFinish
from batchd.engine.outputs import RequestOutput
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import FinishReason
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    expected_fake_tokens,
    fast_settings,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()
ADMIT, ENCODE, OUTPUT = 666, 667, 668


@dataclass
class MisbehavingGenerator(FakeGenerator):
    """Raises at admission, emits unencodable text, or emits an output no event can hold,
    by the first token of the prompt."""

    def start(self, job: JobStart) -> EngineFinish | None:
        if job.prompt_token_ids[0] == ADMIT:
            raise OverflowError("int too large to convert")
        return super().start(job)

    def step(self) -> list[RequestOutput]:
        outs = []
        for out in super().step():
            seq_prompt = self._prompt_of(out.request_id)
            if seq_prompt == ENCODE:
                out = dataclasses.replace(out, text="\ud800", finished=False, finish_reason=None)
            if seq_prompt == OUTPUT:
                bad_logprob: Any = "not a number"  # an engine bug: the event cannot be built
                out = dataclasses.replace(
                    out, logprob=bad_logprob, finished=False, finish_reason=None
                )
            outs.append(out)
        return outs

    def _prompt_of(self, job_id: str) -> int | None:
        return self.first_tokens.get(job_id)

    first_tokens: dict[str, int] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.first_tokens = {}

    def encode(self, job_id: str, request: Any) -> list[int]:
        ids = super().encode(job_id, request)
        self.first_tokens[job_id] = ids[0]
        return ids


def _raise_on_boom(real: Callable[..., Any]) -> Callable[..., Any]:
    def parse(payload: bytes | str, limits: Any = None) -> Any:
        if b"boom" in (payload.encode() if isinstance(payload, str) else payload):
            raise RuntimeError("parser bug")
        return real(payload, limits)

    return parse


def test_a_job_raising_at_any_stage_fails_alone(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pickup, "parse_job", _raise_on_boom(pickup.parse_job))
    client = redis_server.client()
    bad = {
        "parse": {"id": "bad-parse", "prompt": "boom", "max_tokens": 3},
        "admitting": {"id": "bad-admit", "prompt_token_ids": [ADMIT, 1], "max_tokens": 3},
        "encoding": {"id": "bad-encode", "prompt_token_ids": [ENCODE, 1], "max_tokens": 3},
        "taking its output": {"id": "bad-output", "prompt_token_ids": [OUTPUT, 1], "max_tokens": 2},
    }
    good = {f"good{i}": [10 + i, 20, 30] for i in range(6)}
    with worker_thread(fast_settings(redis_server.url), MisbehavingGenerator):
        for i, job in enumerate(bad.values()):
            enqueue(client, KEYS, job)
            enqueue(
                client,
                KEYS,
                {
                    "id": f"good{i}",
                    "prompt_token_ids": good[f"good{i}"],
                    "max_tokens": 5,
                    "seed": i,
                },
            )
        for i in range(len(bad), len(good)):
            enqueue(
                client,
                KEYS,
                {
                    "id": f"good{i}",
                    "prompt_token_ids": good[f"good{i}"],
                    "max_tokens": 5,
                    "seed": i,
                },
            )
        done = wait_final(
            client, KEYS, [*good, "bad-parse", "bad-admit", "bad-encode", "bad-output"], timeout=30
        )
        wait_until(lambda: client.xlen(KEYS.dead) == len(bad), what="a dead letter each")
        wait_until(
            lambda: client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0,
            what="every entry acked",
        )
    for i, (job_id, prompt) in enumerate(good.items()):
        assert token_ids(done[job_id]) == expected_fake_tokens(prompt, i, 5), job_id
    for stage, job in bad.items():
        events = done[job["id"]]
        assert [e.seq for e in events] == list(range(len(events)))
        final = events[-1]
        assert final.finish_reason is FinishReason.error, job["id"]
        expected = "cannot be parsed" if stage == "parse" else f"internal error while {stage}"
        assert expected in (final.error or ""), final.error
        assert sum(e.final for e in events) == 1
    dead = {f[b"id"].decode(): f[b"error"].decode() for _, f in client.xrange(KEYS.dead)}
    assert "cannot be parsed: RuntimeError" in dead["bad-parse"], dead  # under its own id
