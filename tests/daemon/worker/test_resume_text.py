"""A daemon killed while its engine held text back (the start of a stop string) resumes
the job exactly: after a restart, the tokens, every event's text, the finish and the
final event's full text equal an uninterrupted in-process run."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from batchd.engine import LLMEngine, SamplingParams
from batchd.producers.schema import FinishReason, validate_job
from support.daemon_harness import crash_then_resume
from support.redis_server import RedisServer


def _uninterrupted(eng: LLMEngine, job: dict[str, Any]) -> tuple[list[int], list[str], str | None]:
    """Tokens, per-token texts and finish of the job run in-process without a crash."""
    request = validate_job(job)
    eng.add_request(
        "ref",
        prompt_token_ids=request.prompt_token_ids,
        params=SamplingParams(**request.sampling()),
    )
    tokens, texts, finish = [], [], None
    while eng.has_unfinished():
        for out in eng.step():
            tokens.append(out.token_id)
            texts.append(out.text)
            finish = out.finish_reason
    return tokens, texts, finish


def _job_with_a_stop_string(eng: LLMEngine) -> tuple[dict[str, Any], int]:
    """A seeded job whose stop string (taken from its own output) spans several tokens,
    and a cut point inside that stop string, where the engine holds text back."""
    rng = random.Random(7)
    decode = eng.tokenizer.decode
    for i in range(40):
        job: dict[str, Any] = {
            "id": f"stop{i}",
            "prompt_token_ids": [rng.randrange(3, 1000) for _ in range(20)],
            "max_tokens": 40,
            "temperature": 1.0,
            "seed": 500 + i,
        }
        _, texts, _ = _uninterrupted(eng, job)
        text, start = "".join(texts), sum(len(t) for t in texts[:4])
        stop = text[start - 2 : start + 2]  # straddles what tokens 3 and 4 released
        if len(stop) < 4 or "\ufffd" in stop or not stop.isprintable() or stop.strip() != stop:
            continue
        job["stop"] = [stop]
        tokens, texts, _ = _uninterrupted(eng, job)
        stop_at = len("".join(texts))
        cuts = [c for c in range(2, len(tokens)) if len(decode(tokens[:c])) > stop_at]
        if cuts:
            return job, cuts[0]
    raise AssertionError("no job with a stop string spanning tokens")


def test_kill_while_a_stop_string_is_held_back_resumes_exactly(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference_engine: LLMEngine
) -> None:
    job, cut = _job_with_a_stop_string(reference_engine)
    tokens, texts, finish = _uninterrupted(reference_engine, job)
    stop = job["stop"][0]
    decode = reference_engine.tokenizer.decode
    assert finish == "stop" and len(tokens) > cut
    assert "".join(texts) == decode(tokens)[: decode(tokens).index(stop)]
    # At the cut the run has delivered less than the decoded tokens: the stop's start.
    assert len("".join(texts[:cut])) < len(decode(tokens[:cut]))

    # Step 1 prefills the prompt (token 0); decode step n makes token n: dying there
    # leaves tokens 0..n-1 published.
    run = crash_then_resume(redis_server.url, job, cut=cut, model=tiny_model, log_dir=tmp_path)
    assert [e.token_id for e in run.at_crash] == tokens[:cut]
    assert [e.text for e in run.at_crash] == texts[:cut]
    assert f"resumed at seq {cut}" in run.restarted_log
    *token_events, final = run.events
    assert [e.token_id for e in token_events] == tokens
    assert [e.text for e in token_events] == texts
    assert final.finish_reason is FinishReason.stop
    assert final.text == "".join(texts)
