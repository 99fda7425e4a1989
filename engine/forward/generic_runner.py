"""The generic paged path: mlx-lm's own model classes over batchd's KV pool.

Any architecture mlx-lm serves runs here without a port: its model is called
as mlx-lm calls it, with one :class:`PagedLayerCache` per layer in place of
mlx-lm's caches. At each attention call the cache writes the new K/V into the
block pool by slot and returns the sequence's K/V gathered through its block
table; ``make_mask`` builds the mask from the batch's positions (causal, and
the layer's sliding window when the model asks for one). Everything else
(norms, soft-capping, per-layer rope, MoE routing) is mlx-lm's code, as it runs
in mlx-lm.

A step is one model call for all decodes together (rows of one token, each
with its own position: rope's offset is an array, as in mlx-lm's
BatchKVCache) and one call per prefill chunk (one row at an integer offset).
The window of sliding-window layers is applied by the mask. When every layer has
one (ModelSpec.kv_window), the block manager gives back the blocks a sequence's
window has passed and marks them RELEASED in its table: they are read as block 0,
and masked. A model with any full-attention layer keeps every position's K/V in
every layer (one pool shape for all layers), so its sliding layers save nothing.

LoRA adapters apply per row of each call, in the model's adapted layers
(batchd.engine.adapters). The specialised runner (batchd.engine.forward.model_runner)
stays the path of the families it covers; the loader chooses (ModelSpec.generic).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.adapters.resident import AdapterCache, chunk_adapter
from batchd.engine.forward.kv_pool import KVPool
from batchd.engine.forward.kv_quant import take_blocks
from batchd.engine.forward.model_runner import ChunkInput, num_logits
from batchd.engine.models.loader import ModelSpec


@dataclass(frozen=True)
class _Call:
    """One model call: ``rows`` sequences of ``length`` tokens each."""

    tokens: mx.array  # [rows, length] int32
    offset: int | mx.array  # the first position of each row: int, or [rows] int32
    positions: np.ndarray  # [rows, length] position of every token
    slots: mx.array  # [rows * length] pool slot of every token, row-major
    tables: mx.array  # [rows, width] block tables, padded with block 0
    adapters: tuple[str | None, ...]  # each row's LoRA adapter (None: the base model)


class PagedLayerCache:
    """mlx-lm's cache interface (``offset``, ``update_and_fetch``, ``make_mask``) for one
    layer of one call, backed by the pool."""

    def __init__(self, pool: KVPool, layer: int, call: _Call) -> None:
        self._pool = pool
        self._layer = layer
        self._call = call

    @property
    def offset(self) -> int | mx.array:
        return self._call.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [rows, kv_heads, length, D] -> each row's K/V [rows, kv_heads, T, D]."""
        rows, kv_heads, length, dim = keys.shape
        pool, call = self._pool, self._call
        k_new = keys.transpose(1, 0, 2, 3).reshape(kv_heads, rows * length, dim)
        v_new = values.transpose(1, 0, 2, 3).reshape(kv_heads, rows * length, dim)
        pool.write(self._layer, call.slots, k_new, v_new)
        k_blocks, v_blocks = pool.blocked(self._layer)
        width = call.tables.shape[1]
        k = take_blocks(k_blocks, call.tables).reshape(kv_heads, rows, width * pool.block_size, dim)
        v = take_blocks(v_blocks, call.tables).reshape(kv_heads, rows, width * pool.block_size, dim)
        return k.transpose(1, 0, 2, 3).astype(keys.dtype), v.transpose(1, 0, 2, 3).astype(
            values.dtype
        )

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """Boolean [rows, 1, length, T]: a token sees the keys at or before its position
        (and within ``window_size`` of it)."""
        call = self._call
        keys = np.arange(call.tables.shape[1] * self._pool.block_size)
        pos = call.positions[:, :, None]
        visible = keys[None, None, :] <= pos
        if window_size is not None:
            visible &= keys[None, None, :] > pos - window_size
        return mx.array(visible[:, None])

    # Read by some of mlx-lm's code paths; the pool holds the state.
    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False


class GenericRunner:
    """Executes packed batches of ChunkInputs with an mlx-lm model's own forward."""

    def __init__(self, model: nn.Module, spec: ModelSpec, pool: KVPool) -> None:
        self.model = model
        self.spec = spec
        self.pool = pool
        # Decodes of several sequences in one call, unless the model's attention cannot
        # broadcast a per-row mask (gemma2 folds query heads into a 5-D score): one call each.
        self.batched_decodes = _takes_row_masks(model, spec)
        # LoRA adapters of the rows (set by the engine; docs/adapters.md).
        self.adapters: AdapterCache | None = None

    def computed_rows(self, n: int) -> int:
        """Rows a step of ``n`` tokens computes: ``n``."""
        return n

    def execute(self, chunks: Sequence[ChunkInput]) -> mx.array | None:
        """Logits ``[num_sampling_rows, vocab]`` in chunk order (lazy), or None."""
        return self.execute_scored(chunks, {})[0]

    def execute_scored(
        self, chunks: Sequence[ChunkInput], targets: Mapping[int, Sequence[int]]
    ) -> tuple[mx.array | None, dict[int, mx.array]]:
        """As ModelRunner.execute_scored: logits of the sampling chunks in chunk order,
        and the log-probabilities of each ``targets`` chunk's target tokens."""
        if not chunks:
            return None, {}
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        rows: dict[int, mx.array] = {}  # chunk index -> its logits [tokens, vocab]
        if decodes and self.batched_decodes:
            logits = self._run(self._call([chunks[i] for i in decodes], batched=True))
            for j, i in enumerate(decodes):
                rows[i] = logits[j]
        elif decodes:
            for i in decodes:
                rows[i] = self._run(self._call([chunks[i]], batched=False))[0]
        for i in prefills:
            # A prefill chunk whose prompt rows are not scored needs its last row's logits
            # at most: the output head runs on that row alone.
            last = i not in targets and num_logits(chunks[i]) == 1
            rows[i] = self._run(self._call([chunks[i]], batched=False), last_row=last)[0]
        scores = {i: _score(rows[i], t) for i, t in targets.items()}
        # A verify chunk (speculative decoding) gives its last num_logits rows.
        sampled = [rows[i][-num_logits(c) :] for i, c in enumerate(chunks) if c.samples]
        if not sampled:
            mx.eval(self.pool.arrays(), *scores.values())
            return None, scores
        return mx.concatenate(sampled, axis=0), scores

    def _call(self, chunks: Sequence[ChunkInput], *, batched: bool) -> _Call:
        bs = self.pool.block_size
        ends = [c.start + len(c.token_ids) for c in chunks]
        width = -(-max(ends) // bs)
        tables = np.zeros((len(chunks), width), dtype=np.int32)
        for r, (c, end) in enumerate(zip(chunks, ends, strict=True)):
            used = -(-end // bs)
            tables[r, :used] = np.asarray(c.block_table[:used], dtype=np.int32)
            if len(c.slots) != len(c.token_ids):
                raise ValueError(f"{len(c.token_ids)} tokens but {len(c.slots)} slots")
        # Blocks released outside every layer's window are masked: any block may stand in.
        np.maximum(tables, 0, out=tables)
        tokens = np.asarray([list(c.token_ids) for c in chunks], dtype=np.int32)
        starts = np.asarray([c.start for c in chunks], dtype=np.int32)
        positions = starts[:, None] + np.arange(tokens.shape[1], dtype=np.int32)[None, :]
        slots = np.asarray([s for c in chunks for s in c.slots], dtype=np.int32)
        return _Call(
            tokens=mx.array(tokens),
            offset=mx.array(starts) if batched else int(starts[0]),
            positions=positions,
            slots=mx.array(slots),
            tables=mx.array(tables),
            adapters=tuple(chunk_adapter(c) for c in chunks),
        )

    def _run(self, call: _Call, *, last_row: bool = False) -> mx.array:
        spans = [(a, row, 1) for row, a in enumerate(call.adapters)]
        serving = self.adapters.serving(spans) if self.adapters is not None else None
        with serving or nullcontext():
            return self._run_model(call, last_row=last_row)

    def _run_model(self, call: _Call, *, last_row: bool) -> mx.array:
        caches = [PagedLayerCache(self.pool, i, call) for i in range(self.spec.num_layers)]
        inner = getattr(self.model, "model", None)
        if not last_row or not isinstance(inner, nn.Module):
            logits: mx.array = self.model(call.tokens, cache=caches)
            return logits
        # mlx-lm's Model runs its inner model, then the head on every row it returns; for
        # the graph of this call only, the inner model returns its last row (the instance
        # attribute shadows the module entry; every layer still runs on every token).
        self.model.__dict__["model"] = _LastRow(inner)
        try:
            logits = self.model(call.tokens, cache=caches)
        finally:
            del self.model.__dict__["model"]
        return logits


class _LastRow:
    """An inner model whose output is only its last position; attributes pass through."""

    def __init__(self, inner: nn.Module) -> None:
        self._inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._inner(*args, **kwargs)
        return out[:, -1:] if isinstance(out, mx.array) else out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _takes_row_masks(model: nn.Module, spec: ModelSpec) -> bool:
    """Whether ``model`` builds its graph for a few one-token rows with a [rows, 1, 1, T]
    mask (nothing is evaluated). The row count is a prime no head count divides, so a
    wrong broadcast cannot pass by coincidence."""
    caches = [_RowProbe() for _ in range(spec.num_layers)]
    try:
        model(mx.zeros((_PROBE_ROWS, 1), dtype=mx.int32), cache=caches)
    except ValueError:
        return False
    return True


_PROBE_ROWS = 251


class _RowProbe:
    offset = mx.arange(_PROBE_ROWS, dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        shape = (_PROBE_ROWS, keys.shape[1], 3, keys.shape[3])
        return mx.zeros(shape, dtype=keys.dtype), mx.zeros(shape, dtype=values.dtype)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        return mx.ones((_PROBE_ROWS, 1, 1, 3), dtype=mx.bool_)

    @property
    def state(self) -> tuple[()]:
        return ()


def _score(logits: mx.array, targets: Sequence[int]) -> mx.array:
    rows = logits[: len(targets)].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    picked = mx.array(np.asarray(targets, dtype=np.int32))[:, None]
    return mx.take_along_axis(logprobs, picked, axis=-1)[:, 0]
