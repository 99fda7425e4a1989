"""One packed forward per step over the paged KV pool.

All scheduled tokens of all sequences are concatenated into one ``[N]`` row
of ids, so embeddings, projections, norms and the MLP run once over the
whole batch with no padding. Each token carries its own RoPE position (rows
of length 1 with an array offset). New K/V are scattered into the pool by
slot; attention then reads every sequence through its block table (see
engine.paged_attention). Logits are computed only for rows that sample.

The runner knows nothing of the scheduler: it executes plain ChunkInputs,
so tests can drive it with hand-built batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import fast_math
from engine.kv_pool import KVPool
from engine.loader import ModelSpec
from engine.paged_attention import (
    DecodeGroup,
    PrefillChunk,
    decode_attention,
    group_decodes,
    make_decode_group,
    make_prefill_chunk,
    prefill_attention,
)


@dataclass(frozen=True)
class ChunkInput:
    """Tokens of one sequence computed this step.

    ``token_ids`` sit at positions ``start .. start + len - 1``; ``slots`` are
    their pool slots; ``block_table`` covers at least every position up to
    the last one; ``samples`` asks for logits at the last position.
    """

    token_ids: Sequence[int]
    start: int
    slots: Sequence[int]
    block_table: Sequence[int]
    samples: bool


@dataclass(frozen=True)
class _Plan:
    """Index arrays of one step, built once with NumPy and shared by all layers."""

    tokens: mx.array
    positions: mx.array
    slots: mx.array
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    sample_rows: mx.array | None
    sample_order: list[int]  # chunk index of each sampled row, in row order


class ModelRunner:
    """Executes packed batches of ChunkInputs on an mlx-lm Llama-family model."""

    def __init__(self, model: nn.Module, spec: ModelSpec, pool: KVPool) -> None:
        self.model = model
        self.spec = spec
        self.pool = pool
        self._layers = model.layers
        self._scale = self._layers[0].self_attn.scale
        self._fast_math = fast_math.enabled()
        fast_math.tune_malloc()

    def execute(self, chunks: Sequence[ChunkInput]) -> mx.array | None:
        """Run one forward; return logits ``[num_sampling_chunks, vocab]`` in chunk order.

        The result is lazy; the pool's arrays are updated in place (lazily too:
        evaluate the logits, or ``pool.k``/``pool.v`` when nothing samples).
        """
        if not chunks:
            return None
        plan = self._plan(chunks)
        hidden = self._forward(plan)
        if plan.sample_rows is None:
            mx.eval(self.pool.k, self.pool.v)
            return None
        logits = self._logits(hidden[plan.sample_rows])
        if plan.sample_order != sorted(plan.sample_order):
            # Sampled rows come out in packed order; hand them back in chunk order.
            logits = logits[mx.array(np.argsort(plan.sample_order).astype(np.int32))]
        return logits

    def _plan(self, chunks: Sequence[ChunkInput]) -> _Plan:
        bs = self.pool.block_size
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        decodes.sort(key=lambda i: -chunks[i].start)
        prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        order = decodes + prefills
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_order: list[int] = []
        for i in order:
            c = chunks[i]
            n = len(c.token_ids)
            if len(c.slots) != n:
                raise ValueError(f"chunk {i}: {n} tokens but {len(c.slots)} slots")
            tokens.extend(c.token_ids)
            positions.extend(range(c.start, c.start + n))
            slots.extend(c.slots)
            if c.samples:
                sample_rows.append(len(tokens) - 1)
                sample_order.append(i)
        lengths = [chunks[i].start + 1 for i in decodes]
        groups = []
        for a, b in group_decodes(lengths):
            tables = [
                list(chunks[decodes[j]].block_table[: -(-lengths[j] // bs)]) for j in range(a, b)
            ]
            groups.append(
                make_decode_group(
                    a, tables, lengths[a:b], block_size=bs, num_kv_heads=self.spec.num_kv_heads
                )
            )
        row = len(decodes)
        prefill_chunks = []
        for i in prefills:
            c = chunks[i]
            prefill_chunks.append(
                make_prefill_chunk(
                    row, c.start, len(c.token_ids), list(c.block_table), block_size=bs
                )
            )
            row += len(c.token_ids)
        return _Plan(
            tokens=mx.array(np.asarray(tokens, dtype=np.int32)),
            positions=mx.array(np.asarray(positions, dtype=np.int32)),
            slots=mx.array(np.asarray(slots, dtype=np.int32)),
            decode_groups=groups,
            prefills=prefill_chunks,
            sample_rows=mx.array(np.asarray(sample_rows, dtype=np.int32)) if sample_rows else None,
            sample_order=sample_order,
        )

    def _forward(self, plan: _Plan) -> mx.array:
        x = self.model.model.embed_tokens(plan.tokens)
        n = x.shape[0]
        heads, kv_heads, dim = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
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
            self.pool.k[index][:, plan.slots] = k_new
            self.pool.v[index][:, plan.slots] = v_new
            k_blocks, v_blocks = self.pool.blocked(index)
            parts = [
                decode_attention(
                    q[g.row_start : g.row_end], k_blocks, v_blocks, g, scale=self._scale
                )
                for g in plan.decode_groups
            ]
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
            out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            x = x + attn.o_proj(out)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return x

    def _mlp(self, mlp: nn.Module, h: mx.array) -> mx.array:
        if self._fast_math:
            return mlp.down_proj(fast_math.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))
        return mlp(h)

    def _logits(self, hidden: mx.array) -> mx.array:
        inner = self.model.model
        hidden = inner.norm(hidden)
        if getattr(self.model.args, "tie_word_embeddings", False):
            return inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)
