"""Only a request's own fault rejects a job; an engine bug is the daemon's failure.

On the real engine (tiny model): ids outside the vocabulary and bad sampling
values are InvalidRequest and become JobRejected; any other error from the
engine propagates (the worker then fails that job alone as an internal error,
see tests/security/test_one_job_alone.py) instead of being blamed on the job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchd.daemon.worker import mlx_generator
from batchd.daemon.worker.generator import JobRejected, JobStart
from batchd.engine.exceptions import InvalidRequest, RequestRejected
from batchd.producers.schema import validate_job


@pytest.fixture(scope="module")
def generator(tiny_model: Path) -> Any:
    from batchd.daemon.worker.mlx_generator import MLXGenerator
    from batchd.engine import EngineConfig

    return MLXGenerator.from_pretrained(str(tiny_model), EngineConfig(max_model_len=64))


def _start(job: dict[str, object]) -> JobStart:
    request = validate_job({"id": "j", **job})
    return JobStart("j", request, list(request.prompt_token_ids or [1]))


def test_the_requests_fault_rejects_it(generator: Any) -> None:
    with pytest.raises(JobRejected, match="outside the vocabulary"):
        generator.start(_start({"prompt_token_ids": [1, 10**9]}))
    with pytest.raises(JobRejected, match="max_model_len"):
        generator.start(_start({"prompt_token_ids": list(range(1, 80))}))


def test_an_engine_bug_is_not_blamed_on_the_job(
    generator,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("index out of range in the block table")

    monkeypatch.setattr(generator.engine, "add_request", broken)
    with pytest.raises(ValueError, match="block table") as caught:
        generator.start(_start({"prompt_token_ids": [1, 2, 3]}))
    assert not isinstance(caught.value, JobRejected)


def test_a_prompt_the_tokenizer_refuses_is_rejected_and_an_encode_bug_is_not(
    generator,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    request = validate_job({"id": "j", "prompt": "hello"})

    class Refusing:
        def encode(self, text: str) -> list[int]:
            raise ValueError("no chat template")

    monkeypatch.setattr(generator.engine, "tokenizer", Refusing())
    with pytest.raises(JobRejected, match="prompt: .*cannot tokenize: no chat template"):
        generator.encode("j", request)

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug in the engine")

    monkeypatch.setattr(mlx_generator, "encode_prompt", broken)
    with pytest.raises(KeyError):
        generator.encode("j", request)


def test_error_types() -> None:
    assert issubclass(RequestRejected, InvalidRequest)
    assert issubclass(InvalidRequest, ValueError)
