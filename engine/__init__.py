"""batchd's inference engine: paged KV, continuous batching, MLX forward.

Importing this package first preloads OpenBLAS on Linux (see engine.blas) so
that MLX's CPU matrix products are fast. The MLX-backed names are resolved
lazily: the pure-Python scheduling modules (sequence, block_manager,
scheduler) import without MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.blas import preload_openblas

preload_openblas()

_LAZY = {
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.llm_engine",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
