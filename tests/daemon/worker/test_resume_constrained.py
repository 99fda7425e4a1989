"""A daemon killed in the middle of a constrained job resumes it exactly: the restarted
daemon replays the emitted tokens through the job's grammar, so the tokens, the texts and
the final JSON (valid for the schema) equal an uninterrupted in-process run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

from batchd.engine import LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.producers.schema import FinishReason, validate_job
from support.daemon_harness import crash_then_resume, drain
from support.redis_server import RedisServer
from support.schemas import NESTED_SCHEMA

CUT = 20
JOB: dict[str, Any] = {
    "id": "json1",
    "prompt_token_ids": [5 + 7 * j for j in range(24)],
    "max_tokens": 256,
    "temperature": 1.0,
    "seed": 42,
    "response_format": {"type": "json_schema", "json_schema": NESTED_SCHEMA},
}


def _uninterrupted(eng: LLMEngine) -> tuple[list[int], list[str]]:
    request = validate_job(JOB)
    assert request.response_format is not None
    constraint = Constraint(request.response_format.type, request.response_format.source())
    eng.add_request(
        "ref",
        prompt_token_ids=request.prompt_token_ids,
        params=SamplingParams(**request.sampling(), constraint=constraint),
    )
    return drain(eng)


def test_kill_mid_json_resumes_exactly(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference_engine: LLMEngine
) -> None:
    tokens, texts = _uninterrupted(reference_engine)
    assert len(tokens) > CUT + 5
    jsonschema.validate(json.loads("".join(texts)), NESTED_SCHEMA)

    run = crash_then_resume(redis_server.url, JOB, cut=CUT, model=tiny_model, log_dir=tmp_path)
    assert [e.token_id for e in run.at_crash] == tokens[:CUT]
    assert f"resumed at seq {CUT}" in run.restarted_log
    *token_events, final = run.events
    assert [e.token_id for e in token_events] == tokens
    assert [e.text for e in token_events] == texts
    assert final.finish_reason is FinishReason.stop
    jsonschema.validate(json.loads(final.text), NESTED_SCHEMA)
