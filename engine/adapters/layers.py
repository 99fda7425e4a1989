"""The low-rank delta of every adapter in a batch, applied per row inside a linear layer.

A covered layer (one some loaded adapter names) is replaced, for attribute access
only, by an :class:`AdaptedLinear` that calls the original layer and then adds,
for the rows of each adapter in the current forward, mlx-lm's LoRA delta
``(scale * ((x[rows] @ a) @ b)).astype(x.dtype)``: rows of one adapter are
gathered, multiplied by its factors and added back by index, so rows of several
adapters and of the base model share the layer's one product over the whole batch.
Which rows belong to which adapter is the :class:`Switchboard`'s, set by the runner
around the forward (the graph is built inside it; evaluation may come later).

The original layer stays where mlx-lm's parameter tree has it (the replacement
sits in the parent's instance ``__dict__``, which attribute lookup reads first,
as batchd.engine.forward.generic_runner does for its last-row model), so the model's
parameters, a later ``load_weights`` and weight packing done earlier see the plain
model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn

from batchd.engine.adapters.weights import AdapterError, LoRAWeights


@dataclass(frozen=True)
class RowGroup:
    """Rows (along the layer input's first axis) computed with ``weights``: an index
    array, or None for every row of the input."""

    weights: LoRAWeights
    rows: mx.array | None


class Switchboard:
    """Which adapter each row of the forward being built uses; empty: the base model."""

    def __init__(self) -> None:
        self.groups: tuple[RowGroup, ...] = ()

    @contextmanager
    def serving(self, groups: tuple[RowGroup, ...]) -> Iterator[None]:
        """Apply ``groups`` to the graphs built inside the block."""
        if self.groups:
            raise RuntimeError("adapter groups are already set: forwards do not nest")
        self.groups = groups
        try:
            yield
        finally:
            self.groups = ()


class AdaptedLinear:
    """A linear layer plus the LoRA delta of the rows' adapters (see the module doc)."""

    def __init__(self, base: nn.Module, path: str, board: Switchboard) -> None:
        self.base = base
        self.path = path
        self.board = board

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        for group in self.board.groups:
            pair = group.weights.layers.get(self.path)
            if pair is None:
                continue
            scale = group.weights.scale
            if group.rows is None:
                y = y + (scale * ((x @ pair.a) @ pair.b)).astype(x.dtype)
            else:
                delta = (scale * ((x[group.rows] @ pair.a) @ pair.b)).astype(x.dtype)
                y = y.at[group.rows].add(delta)
        return y

    def __getattr__(self, name: str) -> Any:
        # Code that inspects the layer (its weight, dims) sees the original.
        return getattr(self.base, name)


def install(model: nn.Module, weights: LoRAWeights, board: Switchboard) -> None:
    """Make every layer ``weights`` covers an AdaptedLinear reading ``board`` (once per
    layer); raise AdapterError, changing nothing, if one is missing, not a linear
    layer, or of other dimensions than its factors."""
    found: list[tuple[Any, str, Any]] = []  # (parent, attribute, layer)
    for path, pair in weights.layers.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = _module_at(model, parent_path, weights.name)
        layer = getattr(parent, leaf, None)
        if isinstance(layer, AdaptedLinear) and layer.board is not board:
            raise AdapterError(
                f"adapter {weights.name!r}: {path} already serves another engine's "
                "adapters; load the model once per engine"
            )
        base = layer.base if isinstance(layer, AdaptedLinear) else layer
        if not isinstance(base, nn.Linear | nn.QuantizedLinear):
            raise AdapterError(
                f"adapter {weights.name!r}: {path} is {type(base).__name__}, not a linear "
                "layer of the model"
            )
        in_dims, out_dims = linear_dims(base)
        if (pair.a.shape[0], pair.b.shape[1]) != (in_dims, out_dims):
            raise AdapterError(
                f"adapter {weights.name!r}: {path} maps {pair.a.shape[0]} -> "
                f"{pair.b.shape[1]} features, the model's layer {in_dims} -> {out_dims}"
            )
        found.append((parent, leaf, layer))
    for (parent, leaf, layer), path in zip(found, weights.layers, strict=True):
        if not isinstance(layer, AdaptedLinear):
            parent.__dict__[leaf] = AdaptedLinear(layer, path, board)


def linear_dims(layer: nn.Linear | nn.QuantizedLinear) -> tuple[int, int]:
    """(input features, output features) of a linear layer, quantized or not."""
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return int(in_dims), int(out_dims)


def _module_at(model: nn.Module, path: str, name: str) -> Any:
    node: Any = model
    for part in path.split(".") if path else ():
        try:
            node = node[int(part)] if isinstance(node, list) else getattr(node, part)
        except (AttributeError, IndexError, ValueError, KeyError):
            raise AdapterError(f"adapter {name!r}: the model has no module {path!r}") from None
    return node
