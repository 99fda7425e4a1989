"""What the KV pool needs to know of any mlx-lm model, found by running it once.

Attribute names of attention differ from one architecture to the next; the K/V
a layer hands its cache do not. Two tokens through the model with recording
caches give every layer's KV heads, head size and dtype, and the logits' width.
"""

from __future__ import annotations

from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

# (kv_heads, head_dim, dtype) of one layer's K/V
LayerKV = tuple[int, int, mx.Dtype]


class ProbeError(Exception):
    """Layers that stored no K/V of their own during the probe."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__(layers)
        self.layers = layers


def probe_model(model: Any) -> tuple[list[LayerKV], int]:
    """Run ``model`` once on two tokens with recording caches: each layer's (kv_heads,
    head_dim, dtype) of its K/V, in layer order, and the vocabulary size of its logits.
    A layer that never stored K/V is reported as None in its place."""
    layers = len(model.layers)
    seen: list[LayerKV | None] = [None] * layers
    caches = [_ProbeCache(i, seen) for i in range(layers)]
    logits = model(mx.array([[1, 2]], dtype=mx.int32), cache=caches)
    missing = [i for i, s in enumerate(seen) if s is None]
    if missing:
        raise ProbeError(missing)
    return [s for s in seen if s is not None], int(logits.shape[-1])


class _ProbeCache:
    def __init__(self, layer: int, seen: list[LayerKV | None]) -> None:
        self._layer = layer
        self._seen = seen
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._seen[self._layer] = (keys.shape[1], keys.shape[3], keys.dtype)
        return keys, values

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        return mx.array(np.tril(np.ones((n, n), dtype=bool)))

    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False
