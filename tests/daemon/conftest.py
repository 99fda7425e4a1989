"""Fixtures of the daemon tests: the reference engine that says what outputs must be."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import ENGINE_OPTS

Reference = Callable[[list[dict[str, Any]]], dict[str, list[int]]]


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Reference:
    """Token ids the engine produces in-process (uninterrupted) for each job dict."""
    import engine  # noqa: F401  (OpenBLAS before MLX)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from producers.schema import validate_job

    eng = LLMEngine.from_pretrained(tiny_model, EngineConfig(**ENGINE_OPTS))

    def run(jobs: list[dict[str, Any]]) -> dict[str, list[int]]:
        requests = [validate_job(job) for job in jobs]
        outputs = eng.generate(
            [r.prompt_token_ids or [] for r in requests],
            [SamplingParams(**r.sampling()) for r in requests],
        )
        return {str(r.id): out for r, out in zip(requests, outputs, strict=True)}

    return run
