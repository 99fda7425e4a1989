"""Attention over the paged KV pool for a packed batch of tokens, in MLX.

On a CPU with a float32 model the runner uses the C kernel of
batchd.engine.forward.native instead; this is the path everywhere else.

Decode rows (one query each) are attended in groups of similar length: each
group gathers its sequences' blocks into a contiguous
``[kv_heads * B, T, D]`` with queries regrouped as ``[kv_heads * B,
heads / kv_heads, D]``, so attention is one batched product per group with a
padding mask. A prefill chunk attends to its cached prefix plus itself,
causally; a chunk that starts at position 0 reads its own fresh K/V and needs
no gather at all. With a quantized pool (batchd.engine.forward.kv_quant) the gathered
blocks are dequantized, and a first chunk's fresh K/V go through the same round trip,
so every token attends to K/V exactly as the pool holds them.

On CPU the products and a fast softmax (batchd.engine.forward.fast_math) are written out
here, since MLX's CPU SDPA spends most of its time in a slow ``exp``;
elsewhere (Metal) ``mx.fast.scaled_dot_product_attention`` runs them.

MLX runs a stream's elementwise work (gathers, softmax) on one thread, so
on a multi-core CPU the decode groups are cut further into *lanes*, pieces
of about equal work that the runner places on separate streams to run in
parallel (on 2 cores, two streams cut one layer's decode attention by more
than a third; the figures: docs/bench/HISTORY.md, "Figures behind the code's
choices"). Revisit if MLX runs a stream's elementwise work on several threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.forward import fast_math, prefill_buckets
from batchd.engine.forward.kv_quant import Blocks, QuantizedBlocks, take_blocks

# A decode group is closed when its next (shorter) sequence would waste more
# than this fraction of the group's padded key length.
_GROUP_WASTE = 0.5


# Prefill attention runs in blocks of query rows so each block's scores stay
# about this many elements: small temporaries stay in cache.
_SCORE_BLOCK = 1 << 19


@dataclass(frozen=True)
class DecodeGroup:
    """Packed rows [row_start, row_end) that decode together."""

    row_start: int
    row_end: int
    block_tables: mx.array  # [B, num_blocks] int32, padded with block 0
    bias: mx.array  # [kv_heads * B, 1, num_blocks * block_size] float32: 0 or MASKED
    lane: int = 0  # which of the runner's streams computes it


@dataclass(frozen=True)
class PrefillChunk:
    """Packed rows [row_start, row_end) of one sequence starting at position ``start``.

    ``rows`` >= the chunk's tokens: the queries MLX's attention runs on, padded up to a
    bucket where batchd.engine.forward.prefill_buckets asks for it (``blocks`` and
    ``bias`` padded to match: extra blocks are block 0, masked)."""

    row_start: int
    row_end: int
    start: int
    blocks: mx.array | None  # [num_blocks] int32; None when start == 0 (fresh K/V only)
    bias: mx.array  # [rows, keys] float32 (fresh: [n, n]): 0 where query i sees key j, else MASKED
    rows: int  # queries attention runs on: the chunk's tokens, or their bucket


def _bias(visible: np.ndarray) -> mx.array:
    return mx.array(np.where(visible, np.float32(0), np.float32(fast_math.MASKED)))


def group_decodes(lengths: list[int]) -> list[tuple[int, int]]:
    """Split decode rows, sorted by length descending, into [start, end) groups."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] < lengths[start] * (1 - _GROUP_WASTE):
            groups.append((start, i))
            start = i
    return groups


def split_for_lanes(
    lengths: list[int], groups: list[tuple[int, int]], lanes: int
) -> list[tuple[int, int, int]]:
    """Cut each [start, end) group into up to ``lanes`` runs of about equal key length.

    Returns (start, end, lane) pieces; a group's pieces go to distinct lanes,
    rotated from group to group so that no lane gets every group's longest piece.
    """
    pieces: list[tuple[int, int, int]] = []
    for index, (start, end) in enumerate(groups):
        parts = min(lanes, end - start)
        total = sum(lengths[start:end])
        cut, done, acc = start, 0, 0
        for row in range(start, end - 1):
            acc += lengths[row]
            left = end - row - 1  # rows after this one
            if done + 1 < parts and (acc * parts >= total * (done + 1) or left == parts - done - 1):
                pieces.append((cut, row + 1, (index + done) % lanes))
                cut, done = row + 1, done + 1
        pieces.append((cut, end, (index + done) % lanes))
    return pieces


def make_decode_group(
    row_start: int,
    block_tables: list[list[int]],
    lengths: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    lane: int = 0,
) -> DecodeGroup:
    """Index arrays for one decode group (lengths count the new token)."""
    batch = len(lengths)
    width = max(len(t) for t in block_tables)
    table = np.zeros((batch, width), dtype=np.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = t
    keys = np.arange(width * block_size)
    visible = keys[None, :] < np.asarray(lengths)[:, None]
    visible = np.broadcast_to(visible, (num_kv_heads, batch, width * block_size))
    return DecodeGroup(
        row_start=row_start,
        row_end=row_start + batch,
        block_tables=mx.array(table),
        bias=_bias(visible.reshape(num_kv_heads * batch, 1, -1)),
        lane=lane,
    )


def make_prefill_chunk(
    row_start: int,
    start: int,
    num_tokens: int,
    block_table: list[int],
    *,
    block_size: int,
    bucketed: bool = False,
) -> PrefillChunk:
    """Index arrays for one prefill chunk of ``num_tokens`` tokens at ``start``;
    ``bucketed``: queries and keys padded to buckets (prefill_buckets)."""
    row_end = row_start + num_tokens
    rows = prefill_buckets.bucket(num_tokens) if bucketed else num_tokens
    queries = np.arange(start, start + num_tokens)
    if start == 0:
        # MLX's attention masks causally itself (padded queries and their fresh keys both
        # come last); the bias is the CPU path's, which reads the real rows only.
        causal = np.arange(num_tokens)[None, :] <= queries[:, None]
        return PrefillChunk(row_start, row_end, 0, None, _bias(causal), rows)
    num_blocks = -(-(start + num_tokens) // block_size)
    table = np.zeros(num_blocks, dtype=np.int32)
    if bucketed:
        keys = prefill_buckets.bucket(num_blocks * block_size, multiple=block_size)
        table = np.zeros(keys // block_size, dtype=np.int32)
    table[:num_blocks] = block_table[:num_blocks]
    visible = np.arange(len(table) * block_size)[None, :] <= queries[:, None]
    padding = np.zeros((rows - num_tokens, visible.shape[1]), dtype=bool)
    padding[:, 0] = True  # a padded query row sees key 0 alone: finite, then dropped
    bias = _bias(np.concatenate([visible, padding]))
    return PrefillChunk(row_start, row_end, start, mx.array(table), bias, rows)


def _attend(
    queries: mx.array, keys: mx.array, values: mx.array, bias: mx.array, scale: float
) -> mx.array:
    """Attention with an additive bias (0 or MASKED) broadcastable to the scores.

    queries [..., M, D] and keys/values [..., T, D] broadcast over leading axes.
    The bias is added, not selected with `where`: MLX's CPU `where` is much slower.
    """
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    scores = scores.astype(mx.float32) + bias
    return fast_math.softmax(scores).astype(values.dtype) @ values


def decode_attention(
    q: mx.array, k_blocks: Blocks, v_blocks: Blocks, group: DecodeGroup, *, scale: float
) -> mx.array:
    """q: [B, heads, D] -> [B, heads * D], reading K/V through the block tables."""
    batch, heads, dim = q.shape
    keys = take_blocks(k_blocks, group.block_tables)
    kv_heads = keys.shape[0]
    group_size = heads // kv_heads
    keys = keys.reshape(kv_heads * batch, -1, dim)
    values = take_blocks(v_blocks, group.block_tables).reshape(kv_heads * batch, -1, dim)
    queries = q.reshape(batch, kv_heads, group_size, dim).transpose(1, 0, 2, 3)
    queries = queries.reshape(kv_heads * batch, group_size, dim)
    if fast_math.enabled():
        out = _attend(queries, keys, values, group.bias, scale)
    else:
        out = mx.fast.scaled_dot_product_attention(
            queries[:, :, None],
            keys[:, None],
            values[:, None],
            scale=scale,
            mask=group.bias[:, None].astype(queries.dtype),
        )
    out = out.reshape(kv_heads, batch, group_size, dim).transpose(1, 0, 2, 3)
    return out.reshape(batch, heads * dim)


def prefill_attention(
    q: mx.array,
    k_new: mx.array,
    v_new: mx.array,
    k_blocks: Blocks,
    v_blocks: Blocks,
    chunk: PrefillChunk,
    *,
    scale: float,
) -> mx.array:
    """q: [n, heads, D]; k_new/v_new: [kv_heads, n, D] -> [n, heads * D]."""
    n, heads, dim = q.shape
    kv_heads = k_new.shape[0]
    pad = chunk.rows - n
    if pad and not fast_math.enabled():
        q = mx.pad(q, [(0, pad), (0, 0), (0, 0)])
        k_new, v_new = (mx.pad(a, [(0, 0), (0, pad), (0, 0)]) for a in (k_new, v_new))
    if chunk.blocks is None and isinstance(k_blocks, QuantizedBlocks):
        keys, values = k_blocks.round_trip(k_new), k_blocks.round_trip(v_new)
    elif chunk.blocks is None:
        keys, values = k_new, v_new
    else:
        keys = take_blocks(k_blocks, chunk.blocks).reshape(kv_heads, -1, dim)
        values = take_blocks(v_blocks, chunk.blocks).reshape(kv_heads, -1, dim)
    if not fast_math.enabled():
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None],
            keys[None],
            values[None],
            scale=scale,
            mask="causal" if chunk.blocks is None else chunk.bias.astype(q.dtype),
        )
        return out[0, :, :n].transpose(1, 0, 2).reshape(n, heads * dim)
    # Head h = kv * group + g reads KV head kv; a KV head's query heads are folded into
    # rows, [kv_heads, group * rows, D], so each product is a plain batched matmul.
    group = heads // kv_heads
    queries = (q * scale).reshape(n, kv_heads, group, dim).transpose(1, 2, 0, 3)
    rows = max(16, _SCORE_BLOCK // (heads * keys.shape[1]))
    parts = []
    for r in range(0, n, rows):
        m = min(rows, n - r)
        # Causal: rows [r, r + m) see no key past position start + r + m - 1.
        visible = min(keys.shape[1], chunk.start + r + m)
        block = queries[:, :, r : r + m].reshape(kv_heads, group * m, dim)
        scores = block @ keys[:, :visible].swapaxes(-1, -2)
        scores = scores.astype(mx.float32).reshape(kv_heads, group, m, visible)
        weights = fast_math.softmax(scores + chunk.bias[r : r + m, :visible])
        weights = weights.astype(values.dtype).reshape(kv_heads, group * m, visible)
        parts.append((weights @ values[:, :visible]).reshape(kv_heads, group, m, dim))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    return out.transpose(2, 0, 1, 3).reshape(n, heads * dim)
