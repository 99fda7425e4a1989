"""Fixtures of the daemon tests: the reference engine that says what outputs must be."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from support.daemon_harness import ENGINE_OPTS, Reference

if TYPE_CHECKING:
    from batchd.engine import LLMEngine


@pytest.fixture(scope="session")
def reference_engine(tiny_model: Path) -> LLMEngine:
    """The tiny model in-process, with the engine options the test daemons use."""
    import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

    from batchd.engine import EngineConfig, LLMEngine

    return LLMEngine.from_pretrained(tiny_model, EngineConfig(**ENGINE_OPTS))


@pytest.fixture(scope="session")
def reference(reference_engine: LLMEngine) -> Reference:
    """Token ids the engine produces in-process (uninterrupted) for each job dict."""
    from batchd.engine import SamplingParams
    from batchd.producers.schema import validate_job

    def run(jobs: list[dict[str, Any]]) -> dict[str, list[int]]:
        requests = [validate_job(job) for job in jobs]
        outputs = reference_engine.generate(
            [r.prompt_token_ids or [] for r in requests],
            [SamplingParams(**r.sampling()) for r in requests],
        )
        return {str(r.id): out for r, out in zip(requests, outputs, strict=True)}

    return run
