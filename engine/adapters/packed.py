"""LoRA deltas beside the packed C products of a float32 model on a CPU.

The packed forward (batchd.engine.forward.model_runner) computes each layer in four
products over weights packed at load: q, k and v together, o, gate and up together
with SiLU applied inside the product, and down. The delta of an adapted q, k, v, o
or down projection is added to that product's output, in its columns, for the rows
of each adapter: ``out[rows] += scale * ((x[rows] @ a) @ b)``, as mlx-lm's LoRA layer
adds it to the base product. Gate and up cannot take theirs after the fused product
(SiLU comes between), so a layer whose gate or up a batch's adapter covers computes
them with MLX's products, through the adapted layers, and SwiGLU after; the layer's
other products stay packed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchd.engine.adapters.layers import RowGroup
from batchd.engine.adapters.weights import LoRAWeights

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")


class PackedDeltas:
    """The deltas of one step's adapter rows (``groups``, as the Switchboard holds
    them) for a llama-family model of ``heads`` query and ``kv_heads`` KV heads."""

    def __init__(
        self, groups: Sequence[RowGroup], *, heads: int, kv_heads: int, head_dim: int
    ) -> None:
        self._groups: list[tuple[LoRAWeights, np.ndarray | None]] = [
            (g.weights, None if g.rows is None else np.array(g.rows)) for g in groups
        ]
        q, kv = heads * head_dim, kv_heads * head_dim
        # Columns of q, k and v in the packed product's output.
        self._qkv = ((QKV[0], 0, q), (QKV[1], q, q + kv), (QKV[2], q + kv, q + 2 * kv))

    def adapts(self, layer: int, keys: Sequence[str]) -> bool:
        """Whether some adapter of the step covers one of ``keys`` in ``layer``."""
        paths = [f"model.layers.{layer}.{key}" for key in keys]
        return any(p in w.layers for w, _ in self._groups for p in paths)

    def add_qkv(self, out: np.ndarray, x: np.ndarray, layer: int) -> None:
        """Add the q, k and v deltas of input ``x`` to the packed qkv output ``out``."""
        for key, first, end in self._qkv:
            self._add(out, x, f"model.layers.{layer}.{key}", first, end)

    def add(self, out: np.ndarray, x: np.ndarray, layer: int, key: str) -> None:
        """Add the deltas of projection ``key`` (``self_attn.o_proj``, ``mlp.down_proj``)."""
        self._add(out, x, f"model.layers.{layer}.{key}", 0, out.shape[1])

    def _add(self, out: np.ndarray, x: np.ndarray, path: str, first: int, end: int) -> None:
        for weights, rows in self._groups:
            pair = weights.layers.get(path)
            if pair is None:
                continue
            a, b = pair.host
            scale = np.float32(weights.scale)
            if rows is None:
                out[:, first:end] += scale * ((x @ a) @ b)
            else:
                out[rows, first:end] += scale * ((x[rows] @ a) @ b)
