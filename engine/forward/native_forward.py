"""The native_cpu backend's forward: every part of a layer in the C kernels of
batchd.engine.forward.native, on NumPy views of the packed weights and of the KV pool.

MLX computes the embedding and the step's RoPE table only; norms, products, RoPE and
the pool's writes, and attention (decode and prefill rows alike, reading K/V through
the block tables in place) are C, evaluated layer by layer on the host. Rows with LoRA
adapters get their deltas beside the products (batchd.engine.adapters.packed). The
model runner (batchd.engine.forward.model_runner) plans the step and hands this its
rows; the MLX backend's forward stays in the runner.
"""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.adapters.packed import MLP_IN, PackedDeltas
from batchd.engine.adapters.resident import AdapterCache
from batchd.engine.forward import native
from batchd.engine.forward.kv_pool import KVPool
from batchd.engine.forward.packed_model import PackedModel
from batchd.engine.models.loader import ModelSpec


class NativeForward:
    """The packed model's forward over one KV pool."""

    def __init__(
        self, model: nn.Module, spec: ModelSpec, pool: KVPool, packed: PackedModel, *, threads: int
    ) -> None:
        self.model = model
        self.spec = spec
        self.pool = pool
        self.packed = packed
        self.threads = threads
        self._layers = model.layers
        self._scale = self._layers[0].self_attn.scale

    def hidden(
        self,
        tokens: mx.array,
        positions: mx.array,
        slots: mx.array,
        kernel_rows: tuple[np.ndarray, np.ndarray],
        adapters: AdapterCache | None,
    ) -> np.ndarray:
        """The last hidden states ``[rows, hidden]`` of a step's rows (no padding rows);
        each row attends to the keys up to its position through its ``kernel_rows`` table."""
        packed = self.packed
        groups = adapters.board.groups if adapters is not None else ()
        spec = self.spec
        deltas = (
            PackedDeltas(
                groups, heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim
            )
            if groups
            else None
        )
        x = np.array(self.model.model.embed_tokens(tokens), dtype=np.float32)
        table = self._rope_table(positions, traditional=packed.rope_traditional)
        slot_rows = np.array(slots)
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        tables, lengths = kernel_rows
        threads = self.threads
        for index, weights in enumerate(packed.layers):
            k_pool, v_pool = np.asarray(self.pool.k[index]), np.asarray(self.pool.v[index])
            normed = native.rms_norm(x, *weights.input_norm)
            qkv = native.product(normed, weights.qkv, threads=threads)
            if deltas is not None:
                deltas.add_qkv(qkv, normed, index)
            queries = native.rope_store(
                qkv,
                table,
                heads=heads,
                kv_heads=kv_heads,
                traditional=packed.rope_traditional,
                norms=weights.qk_norms,
                k_pool=k_pool,
                v_pool=v_pool,
                slots=slot_rows,
            )
            attended = native.paged_decode(
                queries,
                k_pool,
                v_pool,
                tables,
                lengths,
                block_size=self.pool.block_size,
                scale=self._scale,
                threads=threads,
            ).reshape(len(lengths), -1)
            out = native.product(attended, weights.o, threads=threads)
            if deltas is not None:
                deltas.add(out, attended, index, "self_attn.o_proj")
            x = x + out
            normed = native.rms_norm(x, *weights.post_norm)
            if deltas is not None and deltas.adapts(index, MLP_IN):
                act = self._adapted_swiglu(index, normed)
            else:
                act = native.product(normed, weights.gate_up, threads=threads)
            out = native.product(act, weights.down, threads=threads)
            if deltas is not None:
                deltas.add(out, act, index, "mlp.down_proj")
            x = x + out
        return x

    def logits(self, hidden: np.ndarray) -> mx.array:
        """The output projection of ``hidden`` rows (final norm, then the packed head),
        written straight into an MLX array's buffer: the forward's contract is an
        ``mx.array``, and a copy of ``[rows, vocab]`` costs milliseconds on a CPU."""
        rows = native.rms_norm(np.ascontiguousarray(hidden), *self.packed.final_norm)
        logits = mx.zeros((rows.shape[0], self.packed.head.n), dtype=mx.float32)
        mx.eval(logits)
        native.product(rows, self.packed.head, threads=self.threads, out=np.asarray(logits))
        return logits

    def _adapted_swiglu(self, layer: int, normed: np.ndarray) -> np.ndarray:
        """SwiGLU of a layer whose gate or up projection a row's adapter covers: MLX's
        products through the adapted layers (the packed one applies SiLU inside)."""
        mlp = self._layers[layer].mlp
        h = mx.array(normed)
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        mx.eval(gate, up)
        return native.swiglu(np.asarray(gate), np.asarray(up))

    def _rope_table(self, positions: mx.array, *, traditional: bool) -> np.ndarray:
        """Each row's RoPE rotation [rows, head_dim], from the model's own rope module:
        it rotates a vector that is 1 in each pair's first element and 0 in its second,
        which leaves (cos, sin) of the pair's angle (times any scale the variant applies)
        in the pair's place. Every layer's rope is the same module configuration."""
        dim = self.spec.head_dim
        basis = np.zeros(dim, dtype=np.float32)
        if traditional:
            basis[0::2] = 1.0
        else:
            basis[: dim // 2] = 1.0
        rows = mx.broadcast_to(mx.array(basis), (positions.shape[0], 1, 1, dim))
        rotated = self._layers[0].self_attn.rope(rows, offset=positions)
        return np.array(rotated.reshape(positions.shape[0], dim), dtype=np.float32)
