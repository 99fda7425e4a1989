"""Fixtures of the engine tests: extra fixture models, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny`-shaped qwen3 model (q/k norms, tied embeddings)."""
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(tmp_path_factory.mktemp("models") / "qwen3", FixtureSpec(arch="qwen3"))


@pytest.fixture(scope="session")
def tiny_q4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` llama, 4-bit quantized by mlx-lm's converter."""
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(tmp_path_factory.mktemp("models") / "q4", FixtureSpec(quantize_bits=4))


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from its packaged GGUF (float32), once per session."""
    from batchd.engine.models.gguf_convert import convert_gguf
    from batchd.engine.models.registry import packaged_gguf

    out = tmp_path_factory.mktemp("models") / "smollm2"
    return convert_gguf(packaged_gguf("smollm2"), out, keep_quantized=False)
