"""Jobs with n > 1 through a real daemon (tiny model, real redis-server): every sequence's
tokens on the one events stream tagged with its index, all n in the result, each sequence
equal to the engine's in-process output for its own seed, cancel stopping all of them,
grammars held per sequence, and a daemon killed mid-job resuming each sequence from its
own published tokens. Prompt logprobs come once, with sequence 0's first token."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from batchd.daemon.worker.loop import Worker
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.producers.client import Client
from batchd.producers.keys import EVENT_FIELD, Keys
from batchd.producers.result import JobResult
from batchd.producers.schema import Event, FinishReason, JobRequest, sequence_seed, validate_job
from support.daemon_harness import (
    ENGINE_OPTS,
    crash_then_resume,
    drain,
    fast_settings,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer
from tests.engine.parity_harness import prompt_logprobs_reference

PROMPT = [5 + 7 * j for j in range(40)]


@pytest.fixture
def served(redis_server: RedisServer, tiny_model: Path) -> Iterator[tuple[Worker, Client]]:
    from batchd.daemon.worker.mlx_generator import MLXGenerator

    def make() -> MLXGenerator:
        return MLXGenerator.from_pretrained(str(tiny_model), EngineConfig(**ENGINE_OPTS))

    with worker_thread(fast_settings(redis_server.url), make) as worker:
        with Client(redis_server.url) as client:
            yield worker, client


def _alone(eng: LLMEngine, request: JobRequest, index: int) -> tuple[list[int], list[str]]:
    """Sequence ``index`` of the job run by itself in-process: its tokens and texts."""
    sampling = request.sampling()
    if request.seed is not None:
        sampling["seed"] = sequence_seed(request.seed, index)
    constraint = None
    if request.response_format is not None:
        fmt = request.response_format
        constraint = Constraint(fmt.type, fmt.source())
    eng.add_request(
        "alone",
        prompt_token_ids=request.prompt_token_ids,
        params=SamplingParams(**sampling, constraint=constraint),
    )
    return drain(eng)


def _finished(client: Client, **options: Any) -> tuple[JobResult, list[Event]]:
    """Submit a job of PROMPT and wait: its result and every event."""
    job = client.submit(prompt_token_ids=PROMPT, **options)
    return job.result(timeout=60), list(job.stream())


def _by_index(events: list[Event]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for event in events:
        if not event.final:
            out.setdefault(event.index or 0, []).append(event)
    return out


def test_greedy_sequences_all_equal_the_engine_and_are_tagged(
    served: tuple[Worker, Client], reference_engine: LLMEngine
) -> None:
    _, client = served
    result, events = _finished(client, max_tokens=8, n=3, ignore_eos=True)
    request = validate_job({"prompt_token_ids": PROMPT, "max_tokens": 8, "ignore_eos": True})
    greedy, _ = _alone(reference_engine, request, 0)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.token_ids == greedy for c in result.choices)
    assert result.token_ids == greedy and result.text == result.choices[0].text
    assert sorted(_by_index(events)) == [0, 1, 2]
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT), 24)
    final = events[-1]
    assert final.choices is not None and [c.completion_tokens for c in final.choices] == [8] * 3
    assert client.status(result.id).completion_tokens == 24
    # n=1 looks as it always did: no index, no choices.
    single = client.submit(prompt_token_ids=PROMPT, max_tokens=3)
    single.result(timeout=60)
    raw = client.redis.xrange(Keys().events(single.id))
    decoded = [orjson.loads(fields[EVENT_FIELD.encode()]) for _, fields in raw]
    assert all("index" not in e and "choices" not in e for e in decoded)
    assert len(single.result(timeout=5).choices) == 1


def test_seeded_sequences_follow_their_own_seed_streams(
    served: tuple[Worker, Client], reference_engine: LLMEngine
) -> None:
    _, client = served
    options: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 4}
    result = client.submit(prompt_token_ids=PROMPT, **options).result(timeout=60)
    request = validate_job({"prompt_token_ids": PROMPT, **options})
    for choice in result.choices:
        tokens, texts = _alone(reference_engine, request, choice.index)
        assert choice.token_ids == tokens
        assert choice.text == "".join(texts)
    assert len({tuple(c.token_ids) for c in result.choices}) > 1


def test_each_sequence_is_held_to_the_grammar(served: tuple[Worker, Client]) -> None:
    _, client = served
    fmt = {"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}
    result = client.submit(
        prompt_token_ids=PROMPT, max_tokens=40, temperature=1.0, seed=3, n=3, response_format=fmt
    ).result(timeout=60)
    assert [c.finish_reason for c in result.choices] == [FinishReason.stop] * 3
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) for c in result.choices)


def test_cancel_stops_every_sequence(served: tuple[Worker, Client]) -> None:
    worker, client = served
    job = client.submit(prompt_token_ids=PROMPT, max_tokens=1000, n=4, ignore_eos=True)
    stream = job.stream()
    first = next(stream)
    assert first.token_id is not None
    client.cancel(job.id)
    final = [e for e in stream if e.final][0]
    assert final.finish_reason is FinishReason.cancelled
    assert final.choices is not None
    assert [c.finish_reason for c in final.choices] == [FinishReason.cancelled] * 4
    wait_until(lambda: not worker.gen.has_work(), what="the engine to drop all sequences")


def test_a_killed_daemon_resumes_each_sequence_from_its_own_tokens(
    tmp_path: Path,
    redis_server: RedisServer,
    tiny_model: Path,
    reference_engine: LLMEngine,
) -> None:
    job: dict[str, Any] = {
        "id": "many",
        "prompt_token_ids": PROMPT,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "ignore_eos": True,
    }
    run = crash_then_resume(redis_server.url, job, cut=6, model=tiny_model, log_dir=tmp_path)
    assert 0 < len(run.at_crash) < 3 * 24
    assert "resumed at seq" in run.restarted_log
    request = validate_job(job)
    got = _by_index(run.events)
    for index in range(3):
        tokens, texts = _alone(reference_engine, request, index)
        assert [e.token_id for e in got[index]] == tokens
        assert [e.text for e in got[index]] == texts
    final = run.events[-1]
    assert final.finish_reason is FinishReason.length
    assert final.choices is not None and all(c.completion_tokens == 24 for c in final.choices)


def test_prompt_logprobs_come_once_with_the_first_token(
    served: tuple[Worker, Client], reference_engine: LLMEngine
) -> None:
    _, client = served
    result, events = _finished(client, max_tokens=4, n=2, prompt_logprobs=True)
    assert [e.seq for e in events if e.prompt_logprobs] == [0]
    assert result.prompt_logprobs is not None
    assert [t for t, _ in result.prompt_logprobs] == PROMPT
    assert result.prompt_logprobs[0][1] is None
    want = prompt_logprobs_reference(reference_engine.model, PROMPT)
    np.testing.assert_allclose([lp for _, lp in result.prompt_logprobs[1:]], want, atol=1e-4)
    assert tuple(result.to_dict()["prompt_logprobs"][1]) == result.prompt_logprobs[1]
