"""batchd's inference engine: paged KV, continuous batching, MLX forward.

Importing this package loads nothing but itself: the pure-Python parts (the options,
the scheduling modules) import without MLX or a BLAS. The MLX-backed names below are
resolved lazily, and every module that imports MLX first imports
:mod:`batchd.engine.preload` (OpenBLAS on Linux, before MLX).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLMEngine": "batchd.engine.llm_engine",
    "EngineConfig": "batchd.engine.config",
    "SamplingParams": "batchd.engine.sampling_params",
    "RequestOutput": "batchd.engine.llm_engine",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
