"""Attention over the paged KV pool for a packed batch of tokens.

Decode rows (one query each) are attended in groups of similar length: each
group gathers its sequences' blocks into a contiguous
``[kv_heads * B, 1, T, D]`` with queries regrouped as ``[kv_heads * B,
heads / kv_heads, 1, D]``, so SDPA runs one batched product per group with
a padding mask. A prefill chunk attends to its cached prefix plus itself,
causally; a chunk that starts at position 0 reads its own fresh K/V and needs
no gather at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# A decode group is closed when its next (shorter) sequence would waste more
# than this fraction of the group's padded key length.
_GROUP_WASTE = 0.5


@dataclass(frozen=True)
class DecodeGroup:
    """Packed rows [row_start, row_end) that decode together."""

    row_start: int
    row_end: int
    block_tables: mx.array  # [B, num_blocks] int32, padded with block 0
    mask: mx.array  # [kv_heads * B, 1, 1, num_blocks * block_size] bool: key is real


@dataclass(frozen=True)
class PrefillChunk:
    """Packed rows [row_start, row_end) of one sequence starting at position ``start``."""

    row_start: int
    row_end: int
    start: int
    blocks: mx.array | None  # [num_blocks] int32; None when start == 0
    mask: mx.array | None  # [n, num_blocks * block_size] bool; None when start == 0


def group_decodes(lengths: list[int]) -> list[tuple[int, int]]:
    """Split decode rows, sorted by length descending, into [start, end) groups."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] < lengths[start] * (1 - _GROUP_WASTE):
            groups.append((start, i))
            start = i
    return groups


def make_decode_group(
    row_start: int,
    block_tables: list[list[int]],
    lengths: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
) -> DecodeGroup:
    """Index arrays for one decode group (lengths count the new token)."""
    batch = len(lengths)
    width = max(len(t) for t in block_tables)
    table = np.zeros((batch, width), dtype=np.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = t
    keys = np.arange(width * block_size)
    valid = keys[None, :] < np.asarray(lengths)[:, None]
    mask = np.broadcast_to(valid, (num_kv_heads, batch, width * block_size))
    return DecodeGroup(
        row_start=row_start,
        row_end=row_start + batch,
        block_tables=mx.array(table),
        mask=mx.array(mask.reshape(num_kv_heads * batch, 1, 1, -1)),
    )


def make_prefill_chunk(
    row_start: int, start: int, num_tokens: int, block_table: list[int], *, block_size: int
) -> PrefillChunk:
    """Index arrays for one prefill chunk of ``num_tokens`` tokens at ``start``."""
    row_end = row_start + num_tokens
    if start == 0:
        return PrefillChunk(row_start, row_end, 0, None, None)
    num_blocks = -(-(start + num_tokens) // block_size)
    keys = np.arange(num_blocks * block_size)
    queries = np.arange(start, start + num_tokens)
    mask = keys[None, :] <= queries[:, None]
    return PrefillChunk(
        row_start,
        row_end,
        start,
        mx.array(np.asarray(block_table[:num_blocks], dtype=np.int32)),
        mx.array(mask),
    )


def decode_attention(
    q: mx.array, k_blocks: mx.array, v_blocks: mx.array, group: DecodeGroup, *, scale: float
) -> mx.array:
    """q: [B, heads, D] -> [B, heads * D], reading K/V through the block tables."""
    batch, heads, dim = q.shape
    kv_heads = k_blocks.shape[0]
    keys = k_blocks[:, group.block_tables].reshape(kv_heads * batch, 1, -1, dim)
    values = v_blocks[:, group.block_tables].reshape(kv_heads * batch, 1, -1, dim)
    queries = q.reshape(batch, kv_heads, heads // kv_heads, dim).transpose(1, 0, 2, 3)
    queries = queries.reshape(kv_heads * batch, heads // kv_heads, 1, dim)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=group.mask)
    out = out.reshape(kv_heads, batch, heads // kv_heads, dim).transpose(1, 0, 2, 3)
    return out.reshape(batch, heads * dim)


def prefill_attention(
    q: mx.array,
    k_new: mx.array,
    v_new: mx.array,
    k_blocks: mx.array,
    v_blocks: mx.array,
    chunk: PrefillChunk,
    *,
    scale: float,
) -> mx.array:
    """q: [n, heads, D]; k_new/v_new: [kv_heads, n, D] -> [n, heads * D]."""
    n, heads, dim = q.shape
    queries = q.transpose(1, 0, 2)[None]
    if chunk.blocks is None:
        out = mx.fast.scaled_dot_product_attention(
            queries, k_new[None], v_new[None], scale=scale, mask="causal"
        )
    else:
        kv_heads = k_blocks.shape[0]
        keys = k_blocks[:, chunk.blocks].reshape(1, kv_heads, -1, dim)
        values = v_blocks[:, chunk.blocks].reshape(1, kv_heads, -1, dim)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=chunk.mask
        )
    return out[0].transpose(1, 0, 2).reshape(n, heads * dim)
