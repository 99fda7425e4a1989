"""Weights stored the way CPU BLAS reads them fastest.

mlx-lm's Linear computes ``x @ weight.T`` with ``weight`` stored
``[out, in]``, so OpenBLAS runs its transposed-B kernel. With few rows
(decode), the plain kernel over a ``[in, out]`` copy is faster, most for the
wide output projection, and large prefill products are no slower (the
figures: docs/bench/HISTORY.md, "Figures behind the code's choices"). Results
are bit-identical (same products, same order). Revisit if OpenBLAS's
transposed-B kernel catches up at few rows.

A Linear's weight is replaced by the transposed view of a transposed copy:
the module computes the same thing through the plain kernel and no memory
is added. A tied output projection shares its table with the embedding,
whose row lookups want the original layout, so it gets a transposed copy of
its own (vocab x hidden more memory).
"""

from __future__ import annotations

from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn


def lay_out_for_cpu(model: nn.Module) -> mx.array | None:
    """Re-lay every float Linear weight of ``model`` in place; return the tied output
    projection as ``[hidden, vocab]`` (None when the model has its own ``lm_head``)."""
    # mlx.nn is untyped: its calls are taken as Any.
    modules: Any = model.named_modules()  # type: ignore[no-untyped-call]
    for _, module in modules:
        if type(module) is nn.Linear:
            module.weight = mx.contiguous(module.weight.T).T
    tied = None
    if getattr(model.args, "tie_word_embeddings", False):
        embed = model.model.embed_tokens
        if type(embed) is nn.Embedding:
            tied = mx.contiguous(embed.weight.T)
    mx.eval(model.parameters(), tied if tied is not None else [])  # type: ignore[no-untyped-call]
    return tied
