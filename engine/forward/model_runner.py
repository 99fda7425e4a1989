"""One packed forward per step over the paged KV pool.

All scheduled tokens of all sequences are concatenated into one ``[N]`` row
of ids, so embeddings, projections, norms and the MLP run once over the
whole batch with no padding. Each token carries its own RoPE position (rows
of length 1 with an array offset). New K/V are scattered into the pool by
slot; attention then reads every sequence through its block table (see
batchd.engine.forward.paged_attention). Logits are computed only for rows that sample, and
for the prompt rows of a request that asked for its prompt's logprobs.

Two backends sit behind ``execute_scored`` (batchd.engine.forward.backend), both
returning the sampling rows' logits as an ``mx.array``. On a CPU with a float32 model
(native_cpu), the packed forward (batchd.engine.forward.native_forward) runs every part
of a layer in the C kernels of batchd.engine.forward.native on NumPy views (products
over weights packed at load, batchd.engine.forward.packed_model; RMSNorm; RoPE and the pool's
writes; attention of every row, decode and prefill, reading K/V through the
block tables in place): no MLX evaluation inside a layer. With
BATCHD_NATIVE_PRODUCTS=0, or a model the packing does not cover, the MLX
forward below runs with the C attention and SwiGLU, evaluating the layer's
graph before each call (once or twice a layer). Without the kernels (no compiler,
other dtypes, Metal, a quantized KV pool), the MLX path runs alone. Rows with a
LoRA adapter get its delta from the model's adapted layers on the MLX path, and
beside the packed products on the C path (batchd.engine.adapters, docs/adapters.md).

On the MLX path on a multi-core CPU, decode attention runs on several MLX streams at once
(one thread each): decode groups are cut into lanes (batchd.engine.forward.paged_attention).
Prefill attention stays on one stream: its products are large enough for
BLAS to use every core already, and sharing its KV heads out among streams
measured slower (docs/bench/HISTORY.md, "Figures behind the code's choices"). Streams belong to the
thread that made them, so the runner makes its own on first use in each thread.

The runner knows nothing of the scheduler: it reads chunks through the small
ChunkInput protocol, so tests can drive it with hand-built batches. How a step's chunks
are packed into rows (order, padding, slots, block tables) is
batchd.engine.forward.step_plan's; this module runs the plan.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.adapters.resident import AdapterCache, chunk_adapter
from batchd.engine.forward import cuda_paged, fast_math, native
from batchd.engine.forward.backend import AUTO, CUDA_PAGED, NATIVE_CPU, BackendChoice
from batchd.engine.forward.backend import choose as choose_backend
from batchd.engine.forward.cuda_paged import KernelShape
from batchd.engine.forward.kv_pool import KVPool
from batchd.engine.forward.native_forward import NativeForward
from batchd.engine.forward.packed_model import pack_model
from batchd.engine.forward.paged_attention import decode_attention, prefill_attention
from batchd.engine.forward.step_plan import (
    ROW_MULTIPLE,
    ChunkInput,
    PagedDecodes,
    StepPlan,
    num_logits,
    padded_rows,
    plan_step,
    round_up,
)
from batchd.engine.models.loader import ModelSpec
from batchd.engine.models.weight_layout import lay_out_for_cpu

# Most attention streams on a CPU: beyond a few, memory bandwidth is the limit.
MAX_LANES = 4


def cpu_lanes() -> int:
    """Attention streams to use on a CPU: one per core, up to MAX_LANES."""
    return max(1, min(MAX_LANES, os.cpu_count() or 1))


# Hidden states and logits: lazy MLX arrays, or NumPy arrays from the packed products.
Logits = mx.array | np.ndarray


class ModelRunner:
    """Executes packed batches of ChunkInputs on an mlx-lm Llama-family model."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        pool: KVPool,
        *,
        lanes: int | None = None,
        backend: BackendChoice | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.pool = pool
        on_cpu = mx.default_device() == mx.cpu
        self.lanes = lanes if lanes is not None else cpu_lanes() if on_cpu else 1
        if self.lanes < 1:
            raise ValueError(f"lanes={self.lanes} must be >= 1")
        self._layers = model.layers
        self._scale = self._layers[0].self_attn.scale
        self._fast_math = fast_math.enabled()
        self._streams: dict[int, list[mx.Stream]] = {}
        self._tied_head = lay_out_for_cpu(model) if on_cpu else None
        self._row_multiple = ROW_MULTIPLE if on_cpu else 1
        # The C kernels read a float pool in place; a quantized one runs on MLX's path.
        self.backend = backend or choose_backend(
            AUTO,
            dtype=spec.dtype,
            quantized_kv=pool.quant is not None,
            shape=KernelShape(spec.num_heads, spec.num_kv_heads, spec.head_dim),
        )
        self.native_attention = self.backend.name == NATIVE_CPU
        # Decode rows through the CUDA paged kernel (batchd.engine.forward.cuda_paged).
        self.cuda_paged = self.backend.attention == CUDA_PAGED
        # Prefill attention at bucketed shapes (batchd.engine.forward.prefill_buckets).
        self.bucket_prefill = self.backend.prefill_buckets
        self._scale_array = mx.array([self._scale], dtype=mx.float32)
        self._threads = cpu_lanes()
        self._packed = (
            pack_model(model, spec) if self.native_attention and native.products_enabled() else None
        )
        self._native: NativeForward | None = None
        if self._packed is not None:
            # The C products read the packed weights and take any row count at full speed.
            self._native = NativeForward(model, spec, pool, self._packed, threads=self._threads)
            self._tied_head = None
            self._row_multiple = 1
        # Asked once: the scheduler calls computed_rows every step.
        self._tile_rows = native.tile_rows() if self._packed is not None else 0
        fast_math.tune_malloc()
        # LoRA adapters of the rows (set by the engine; docs/adapters.md).
        self.adapters: AdapterCache | None = None

    def computed_rows(self, n: int) -> int:
        """Rows the linear layers compute for a step of ``n`` tokens: ``n`` rounded up to
        the C products' row tile, or to the padding of MLX's CPU products from
        _MIN_PADDED rows up; ``n`` where nothing is known (a GPU). A step costs about as
        much as one of that many tokens."""
        if self._tile_rows:
            return round_up(n, self._tile_rows)
        return padded_rows(n, self._row_multiple)

    def _lane_streams(self) -> list[mx.Stream]:
        """This thread's attention streams (MLX streams are thread-local)."""
        thread = threading.get_ident()
        streams = self._streams.get(thread)
        if streams is None:
            device = mx.default_device()
            streams = [mx.default_stream(device)]
            streams += [mx.new_stream(device) for _ in range(self.lanes - 1)]
            self._streams[thread] = streams
        return streams

    def execute(self, chunks: Sequence[ChunkInput]) -> mx.array | None:
        """Run one forward; return logits ``[num_sampling_rows, vocab]`` in chunk order
        (one row per sampling chunk, ``num_logits`` rows for a verify chunk).

        On the MLX backend the result is lazy and the pool's arrays are updated in place
        (lazily too: evaluate the logits, or ``pool.k``/``pool.v`` when nothing samples);
        with the packed products (the native_cpu backend) it is computed already.
        """
        return self.execute_scored(chunks, {})[0]

    def execute_scored(
        self,
        chunks: Sequence[ChunkInput],
        targets: Mapping[int, Sequence[int]],
        fed: mx.array | None = None,
    ) -> tuple[mx.array | None, dict[int, mx.array]]:
        """:meth:`execute`, and for each chunk index in ``targets`` the log-probabilities
        (float32 log-softmax of the logits) of its target tokens: target k is scored at
        the chunk's k-th token, so it is the token that follows it. Only the rows of
        those chunks go through the output projection for it.

        ``fed`` (MLX backend, one-token chunks only) replaces the chunks' input ids: int32
        ``[len(chunks)]`` in chunk order, possibly still lazy, so that a step can start on
        the ids the previous step samples before the host has read them (async
        scheduling, batchd.engine.async_step)."""
        if not chunks:
            return None, {}
        plan = self._plan(chunks, fed)
        serving = self._adapters_serving(chunks, plan)
        if serving is None:
            hidden = self._forward(plan) if self._packed is None else self._packed_forward(plan)
        else:
            # The model's adapted layers read the rows' adapters from the board.
            with serving:
                hidden = self._forward(plan) if self._packed is None else self._packed_forward(plan)
        scores = {i: self._score(hidden, plan.first_rows[i], t) for i, t in targets.items()}
        if plan.sample_rows is None:
            mx.eval(self.pool.arrays(), *scores.values())
            return None, scores
        return self._sampled_logits(hidden, plan), scores

    def _adapters_serving(
        self, chunks: Sequence[ChunkInput], plan: StepPlan
    ) -> AbstractContextManager[None] | None:
        if self.adapters is None or not self.adapters.paths:  # none served: base rows only
            return None
        first = plan.first_rows
        spans = [(chunk_adapter(c), first[i], len(c.token_ids)) for i, c in enumerate(chunks)]
        return self.adapters.serving(spans)

    def _score(self, hidden: Logits, first_row: int, targets: Sequence[int]) -> mx.array:
        logits = self._logits(hidden[first_row : first_row + len(targets)])
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.array(np.asarray(targets, dtype=np.int32))[:, None]
        return mx.take_along_axis(logprobs, picked, axis=-1)[:, 0]

    def _sampled_logits(self, hidden: Logits, plan: StepPlan) -> mx.array:
        assert plan.sample_rows is not None
        logits = self._logits(_take(hidden, plan.sample_rows))
        if plan.sample_order != sorted(plan.sample_order):
            # Sampled rows come out in packed order; hand them back in chunk order.
            order = np.argsort(plan.sample_order, kind="stable").astype(np.int32)
            logits = logits[mx.array(order)]
        elif logits.shape[0] > len(plan.sample_order):
            logits = logits[: len(plan.sample_order)]  # drop the padding rows
        return logits

    def _plan(self, chunks: Sequence[ChunkInput], fed: mx.array | None = None) -> StepPlan:
        return plan_step(
            chunks,
            fed,
            block_size=self.pool.block_size,
            row_multiple=self._row_multiple,
            lanes=self.lanes,
            num_kv_heads=self.spec.num_kv_heads,
            kernel=self.native_attention,
            packed=self._packed is not None,
            paged_decodes=self.cuda_paged,
            bucket_prefill=self.bucket_prefill,
        )

    def _forward(self, plan: StepPlan) -> mx.array:
        streams = self._lane_streams()
        x: mx.array = self.model.model.embed_tokens(plan.tokens)
        n, real = x.shape[0], plan.slots.shape[0]  # rows with padding, rows of real tokens
        heads, kv_heads, dim = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        padding = mx.zeros((n - real, heads * dim), dtype=x.dtype) if n > real else None
        for index, layer in enumerate(self._layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).reshape(n, heads, dim)
            k = attn.k_proj(h).reshape(n, kv_heads, dim)
            v = attn.v_proj(h).reshape(n, kv_heads, dim)
            if self.spec.qk_norm:
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            q = attn.rope(q[:, :, None, :], offset=plan.positions)[:, :, 0, :]
            k = attn.rope(k[:, :, None, :], offset=plan.positions)[:, :, 0, :]
            k_new = k.transpose(1, 0, 2)
            v_new = v.transpose(1, 0, 2)
            self.pool.write(index, plan.slots, k_new[:, :real], v_new[:, :real])
            k_blocks, v_blocks = self.pool.blocked(index)
            parts = []
            if plan.kernel_rows is not None:
                attended = self._kernel_attention(q[:real], index, plan.kernel_rows)
                parts.append(mx.array(attended))
            if plan.paged_decodes is not None:
                parts.append(self._paged_decode(q, index, plan.paged_decodes))
            for g in plan.decode_groups:
                with mx.stream(streams[g.lane]):
                    queries = q[g.row_start : g.row_end]
                    parts.append(
                        decode_attention(queries, k_blocks, v_blocks, g, scale=self._scale)
                    )
            for p in plan.prefills:
                rows = slice(p.row_start, p.row_end)
                parts.append(
                    prefill_attention(
                        q[rows],
                        k_new[:, rows],
                        v_new[:, rows],
                        k_blocks,
                        v_blocks,
                        p,
                        scale=self._scale,
                    )
                )
            if padding is not None:
                parts.append(padding)
            out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            x = x + attn.o_proj(out)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return x

    def _paged_decode(self, q: mx.array, layer: int, rows: PagedDecodes) -> mx.array:
        """The decode rows' attention by the CUDA paged kernel, [rows, heads * dim]."""
        return cuda_paged.paged_decode(
            q[: rows.count],
            self.pool.k[layer],
            self.pool.v[layer],
            rows.tables,
            rows.lengths,
            self._scale_array,
            block_size=self.pool.block_size,
        )

    def _packed_forward(self, plan: StepPlan) -> np.ndarray:
        """The native_cpu backend's forward (batchd.engine.forward.native_forward)."""
        assert self._native is not None and plan.kernel_rows is not None
        return self._native.hidden(
            plan.tokens, plan.positions, plan.slots, plan.kernel_rows, self.adapters
        )

    def _kernel_attention(
        self, queries: mx.array, layer: int, rows: tuple[np.ndarray, np.ndarray]
    ) -> np.ndarray:
        """Every real row's attention by the C kernel, [rows, heads * dim]; the graph so
        far is evaluated here."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        mx.eval(queries, k, v)
        tables, lengths = rows
        out = native.paged_decode(
            np.asarray(queries),
            np.asarray(k),
            np.asarray(v),
            tables,
            lengths,
            block_size=self.pool.block_size,
            scale=self._scale,
            threads=self._threads,
        )
        return out.reshape(len(lengths), -1)

    def _mlp(self, mlp: Any, h: mx.array) -> mx.array:
        out: mx.array
        if self.native_attention:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            mx.eval(gate, up)
            out = mlp.down_proj(mx.array(native.swiglu(np.asarray(gate), np.asarray(up))))
        elif self._fast_math:
            out = mlp.down_proj(fast_math.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))
        else:
            out = mlp(h)
        return out

    def _logits(self, hidden: Logits) -> mx.array:
        if self._native is not None:
            assert isinstance(hidden, np.ndarray)
            return self._native.logits(hidden)
        assert isinstance(hidden, mx.array)
        inner = self.model.model
        normed: mx.array = inner.norm(hidden)
        logits: mx.array
        if self._tied_head is not None:
            logits = normed @ self._tied_head
        elif getattr(self.model.args, "tie_word_embeddings", False):
            logits = inner.embed_tokens.as_linear(normed)
        else:
            logits = self.model.lm_head(normed)
        return logits


def _take(rows: Logits, index: np.ndarray) -> Logits:
    """``rows[index]`` of either kind of array."""
    if isinstance(rows, np.ndarray):
        taken: np.ndarray = rows[index]
        return taken
    return rows[mx.array(index)]


__all__ = [
    "MAX_LANES",
    "ROW_MULTIPLE",
    "ChunkInput",
    "Logits",
    "ModelRunner",
    "cpu_lanes",
    "num_logits",
    "padded_rows",
    "round_up",
]
