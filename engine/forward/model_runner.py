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
ChunkInput protocol, so tests can drive it with hand-built batches.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.adapters.resident import AdapterCache, chunk_adapter
from batchd.engine.forward import fast_math, native
from batchd.engine.forward.backend import AUTO, NATIVE_CPU, BackendChoice
from batchd.engine.forward.backend import choose as choose_backend
from batchd.engine.forward.kv_pool import KVPool
from batchd.engine.forward.native_forward import NativeForward
from batchd.engine.forward.packed_model import pack_model
from batchd.engine.forward.paged_attention import (
    DecodeGroup,
    PrefillChunk,
    decode_attention,
    group_decodes,
    make_decode_group,
    make_prefill_chunk,
    prefill_attention,
    split_for_lanes,
)
from batchd.engine.models.loader import ModelSpec
from batchd.engine.models.weight_layout import lay_out_for_cpu

# Most attention streams on a CPU: beyond a few, memory bandwidth is the limit.
MAX_LANES = 4

# On CPU the packed batch, and the rows the output projection runs on, are padded to a
# multiple of this many rows (from _MIN_PADDED rows up): OpenBLAS's sgemm handles a partial
# block of 16 rows slowly (figures: docs/bench/HISTORY.md, "Figures behind the code's
# choices"). Below _MIN_PADDED rows the small products are cheaper as they are. Revisit
# with another BLAS or when the engine's own products take these rows.
ROW_MULTIPLE = 16
_MIN_PADDED = 4


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(n: int, multiple: int) -> int:
    """Rows the linear layers run on for ``n`` tokens."""
    if multiple <= 1 or n < _MIN_PADDED:
        return n
    return round_up(n, multiple)


def cpu_lanes() -> int:
    """Attention streams to use on a CPU: one per core, up to MAX_LANES."""
    return max(1, min(MAX_LANES, os.cpu_count() or 1))


class ChunkInput(Protocol):
    """Tokens of one sequence computed this step, as the runner reads them.

    ``token_ids`` sit at positions ``start .. start + len - 1``; ``slots`` are
    their pool slots; ``block_table`` covers at least every position up to
    the last one; ``samples`` asks for logits at the last position (at the last
    ``num_logits`` positions where a chunk has that attribute: a speculative verify
    chunk). The scheduler's ScheduledChunk is one; tests build their own.
    """

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start(self) -> int: ...

    @property
    def slots(self) -> Sequence[int]: ...

    @property
    def block_table(self) -> Sequence[int]: ...

    @property
    def samples(self) -> bool: ...


# Hidden states and logits: lazy MLX arrays, or NumPy arrays from the packed products.
Logits = mx.array | np.ndarray


@dataclass(frozen=True)
class _Plan:
    """Index arrays of one step, built once with NumPy and shared by all layers."""

    tokens: mx.array
    positions: mx.array
    slots: mx.array
    decode_groups: list[DecodeGroup]
    # With the C kernel, instead of decode groups and prefill chunks: every real row's
    # block table [rows, width] and number of keys to attend [rows].
    kernel_rows: tuple[np.ndarray, np.ndarray] | None
    prefills: list[PrefillChunk]
    sample_rows: np.ndarray | None
    sample_order: list[int]  # chunk index of each sampled row, in row order
    first_rows: dict[int, int]  # chunk index -> its first packed row


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
            AUTO, dtype=spec.dtype, quantized_kv=pool.quant is not None
        )
        self.native_attention = self.backend.name == NATIVE_CPU
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
        self, chunks: Sequence[ChunkInput], plan: _Plan
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

    def _sampled_logits(self, hidden: Logits, plan: _Plan) -> mx.array:
        assert plan.sample_rows is not None
        logits = self._logits(_take(hidden, plan.sample_rows))
        if plan.sample_order != sorted(plan.sample_order):
            # Sampled rows come out in packed order; hand them back in chunk order.
            order = np.argsort(plan.sample_order, kind="stable").astype(np.int32)
            logits = logits[mx.array(order)]
        elif logits.shape[0] > len(plan.sample_order):
            logits = logits[: len(plan.sample_order)]  # drop the padding rows
        return logits

    def _plan(self, chunks: Sequence[ChunkInput], fed: mx.array | None = None) -> _Plan:
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        decodes.sort(key=lambda i: -chunks[i].start)
        prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        order = decodes + prefills
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_order: list[int] = []
        first_rows: dict[int, int] = {}
        for i in order:
            c = chunks[i]
            n = len(c.token_ids)
            if len(c.slots) != n:
                raise ValueError(f"chunk {i}: {n} tokens but {len(c.slots)} slots")
            first_rows[i] = len(tokens)
            tokens.extend(c.token_ids)
            positions.extend(range(c.start, c.start + n))
            slots.extend(c.slots)
            if c.samples:
                # A verify chunk (speculative decoding) needs logits at each of its rows.
                m = num_logits(c)
                sample_rows.extend(range(len(tokens) - m, len(tokens)))
                sample_order.extend([i] * m)
        if self.native_attention:
            kernel_rows = self._kernel_rows(chunks, order, positions)
            groups, prefill_chunks = [], []
        else:
            kernel_rows = None
            groups = self._decode_groups(chunks, decodes)
            prefill_chunks = self._prefill_chunks(chunks, prefills, first_rows)
        # Padding rows: token 0 at position 0, never written to the pool nor attended; the
        # output projection runs on padded rows too (repeats of row 0, dropped after).
        padding = padded_rows(len(tokens), self._row_multiple) - len(tokens)
        if sample_rows:
            sample_rows += [0] * (
                padded_rows(len(sample_rows), self._row_multiple) - len(sample_rows)
            )
        return _Plan(
            tokens=self._input_ids(tokens, padding, fed, order),
            positions=mx.array(np.asarray(positions + [0] * padding, dtype=np.int32)),
            slots=mx.array(np.asarray(slots, dtype=np.int32)),
            decode_groups=groups,
            kernel_rows=kernel_rows,
            prefills=prefill_chunks,
            sample_rows=np.asarray(sample_rows, dtype=np.int32) if sample_rows else None,
            sample_order=sample_order,
            first_rows=first_rows,
        )

    def _input_ids(
        self, tokens: list[int], padding: int, fed: mx.array | None, order: list[int]
    ) -> mx.array:
        """The packed input ids: the chunks' own, or ``fed`` put in packed order."""
        if fed is None:
            return mx.array(np.asarray(tokens + [0] * padding, dtype=np.int32))
        if len(tokens) != len(order) or fed.shape != (len(order),) or self._packed is not None:
            raise ValueError(
                f"fed ids {fed.shape} for {len(tokens)} tokens of {len(order)} chunks: they "
                "feed one-token chunks, one id each, on the MLX forward only"
            )
        packed = fed.astype(mx.int32)[mx.array(np.asarray(order, dtype=np.int32))]
        if not padding:
            return packed
        return mx.concatenate([packed, mx.zeros((padding,), dtype=mx.int32)])

    def _kernel_rows(
        self, chunks: Sequence[ChunkInput], order: list[int], positions: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row attends to the keys up to its own position through its chunk's table:
        a prefill row is a decode row of a shorter sequence."""
        bs = self.pool.block_size
        lengths = np.asarray(positions, dtype=np.int32) + 1
        width = -(-int(lengths.max()) // bs)
        tables = np.zeros((len(positions), width), dtype=np.int32)
        row = 0
        for i in order:
            c = chunks[i]
            n = len(c.token_ids)
            used = -(-(c.start + n) // bs)
            tables[row : row + n, :used] = np.asarray(c.block_table[:used], dtype=np.int32)
            row += n
        return tables, lengths

    def _decode_groups(self, chunks: Sequence[ChunkInput], decodes: list[int]) -> list[DecodeGroup]:
        bs = self.pool.block_size
        lengths = [chunks[i].start + 1 for i in decodes]
        groups = []
        for a, b, lane in split_for_lanes(lengths, group_decodes(lengths), self.lanes):
            tables = [
                list(chunks[decodes[j]].block_table[: -(-lengths[j] // bs)]) for j in range(a, b)
            ]
            groups.append(
                make_decode_group(
                    a,
                    tables,
                    lengths[a:b],
                    block_size=bs,
                    num_kv_heads=self.spec.num_kv_heads,
                    lane=lane,
                )
            )
        return groups

    def _prefill_chunks(
        self, chunks: Sequence[ChunkInput], prefills: list[int], first_rows: dict[int, int]
    ) -> list[PrefillChunk]:
        bs = self.pool.block_size
        return [
            make_prefill_chunk(
                first_rows[i],
                chunks[i].start,
                len(chunks[i].token_ids),
                list(chunks[i].block_table),
                block_size=bs,
            )
            for i in prefills
        ]

    def _forward(self, plan: _Plan) -> mx.array:
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

    def _packed_forward(self, plan: _Plan) -> np.ndarray:
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


def num_logits(chunk: ChunkInput) -> int:
    """Rows of logits a sampling chunk needs: its ``num_logits`` if it has one, else 1."""
    return int(getattr(chunk, "num_logits", 1))


def _take(rows: Logits, index: np.ndarray) -> Logits:
    """``rows[index]`` of either kind of array."""
    if isinstance(rows, np.ndarray):
        taken: np.ndarray = rows[index]
        return taken
    return rows[mx.array(index)]
