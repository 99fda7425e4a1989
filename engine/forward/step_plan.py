"""A step's packed inputs: the chunks' tokens as one row of ids, and the index arrays
every layer shares (positions, pool slots, block tables, the rows that sample).

Decode rows come first, longest sequence first, then the prefill chunks. The packed
batch is padded to the row multiple of the CPU's products (ROW_MULTIPLE), and so are
the rows the output projection runs on. Attention reads its rows either through the C
kernel's per-row block tables (``kernel_rows``) or through MLX's decode groups and
prefill chunks (batchd.engine.forward.paged_attention); on a CUDA GPU the decode rows
go to the paged kernel instead of groups (``paged_decodes``, per-row tables as device
arrays; batchd.engine.forward.cuda_paged). Built once a step with NumPy
by ModelRunner (batchd.engine.forward.model_runner), which reads chunks through the
small ChunkInput protocol, so tests can drive it with hand-built batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.forward.paged_attention import (
    DecodeGroup,
    PrefillChunk,
    group_decodes,
    make_decode_group,
    make_prefill_chunk,
    split_for_lanes,
)

# On CPU the packed batch, and the rows the output projection runs on, are padded to a
# multiple of this many rows (from _MIN_PADDED rows up): OpenBLAS's sgemm handles a partial
# block of 16 rows slowly (figures: docs/bench/HISTORY.md, "Figures behind the code's
# choices"). Below _MIN_PADDED rows the small products are cheaper as they are. Revisit
# with another BLAS or when the engine's own products take these rows.
ROW_MULTIPLE = 16
_MIN_PADDED = 4

# The CUDA paged kernel runs one thread block per (decode row, KV head), which leaves most
# of a GPU idle for a few rows: below this many blocks a step's decode rows gather instead
# (the figures: docs/bench/HISTORY.md, "Figures behind the code's choices"). Revisit when
# the kernel splits a row's keys over blocks.
PAGED_MIN_BLOCKS = 64


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(n: int, multiple: int) -> int:
    """Rows the linear layers run on for ``n`` tokens."""
    if multiple <= 1 or n < _MIN_PADDED:
        return n
    return round_up(n, multiple)


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


def num_logits(chunk: ChunkInput) -> int:
    """Rows of logits a sampling chunk needs: its ``num_logits`` if it has one, else 1."""
    return int(getattr(chunk, "num_logits", 1))


@dataclass(frozen=True)
class PagedDecodes:
    """The first ``count`` packed rows (the decodes) for the CUDA paged kernel: each row's
    block table ``[count, width]`` and keys to attend ``[count]``, int32."""

    count: int
    tables: mx.array
    lengths: mx.array


@dataclass(frozen=True)
class StepPlan:
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
    # With the CUDA paged kernel: the decode rows, instead of decode groups.
    paged_decodes: PagedDecodes | None = None


def plan_step(
    chunks: Sequence[ChunkInput],
    fed: mx.array | None,
    *,
    block_size: int,
    row_multiple: int,
    lanes: int,
    num_kv_heads: int,
    kernel: bool,
    packed: bool,
    paged_decodes: bool = False,
    bucket_prefill: bool = False,
) -> StepPlan:
    """The plan of a step of ``chunks`` over a pool of ``block_size`` blocks, padded to
    ``row_multiple`` rows. ``kernel``: attention runs in the C kernel (per-row block
    tables), else in MLX's decode groups over ``lanes`` streams (the CUDA paged kernel
    with ``paged_decodes``, from PAGED_MIN_BLOCKS blocks up) and prefill chunks (padded
    to buckets with ``bucket_prefill``: batchd.engine.forward.prefill_buckets).
    ``fed`` replaces one-token chunks' ids (ModelRunner.execute_scored), never with the
    ``packed`` products. Raises ValueError for a chunk whose slots and tokens differ in
    number, or ``fed`` ids that do not fit."""
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
    paged: PagedDecodes | None = None
    groups: list[DecodeGroup] = []
    prefill_chunks: list[PrefillChunk] = []
    if kernel:
        kernel_rows = _kernel_rows(chunks, order, positions, block_size)
    else:
        kernel_rows = None
        if paged_decodes and len(decodes) * num_kv_heads >= PAGED_MIN_BLOCKS:
            tables, lengths = _kernel_rows(chunks, decodes, positions[: len(decodes)], block_size)
            paged = PagedDecodes(len(decodes), mx.array(tables), mx.array(lengths))
        else:
            groups = _decode_groups(chunks, decodes, block_size, lanes, num_kv_heads)
        prefill_chunks = _prefill_chunks(chunks, prefills, first_rows, block_size, bucket_prefill)
    # Padding rows: token 0 at position 0, never written to the pool nor attended; the
    # output projection runs on padded rows too (repeats of row 0, dropped after).
    padding = padded_rows(len(tokens), row_multiple) - len(tokens)
    if sample_rows:
        sample_rows += [0] * (padded_rows(len(sample_rows), row_multiple) - len(sample_rows))
    return StepPlan(
        tokens=_input_ids(tokens, padding, fed, order, packed),
        positions=mx.array(np.asarray(positions + [0] * padding, dtype=np.int32)),
        slots=mx.array(np.asarray(slots, dtype=np.int32)),
        decode_groups=groups,
        kernel_rows=kernel_rows,
        prefills=prefill_chunks,
        sample_rows=np.asarray(sample_rows, dtype=np.int32) if sample_rows else None,
        sample_order=sample_order,
        first_rows=first_rows,
        paged_decodes=paged,
    )


def _input_ids(
    tokens: list[int], padding: int, fed: mx.array | None, order: list[int], packed: bool
) -> mx.array:
    """The packed input ids: the chunks' own, or ``fed`` put in packed order."""
    if fed is None:
        return mx.array(np.asarray(tokens + [0] * padding, dtype=np.int32))
    if len(tokens) != len(order) or fed.shape != (len(order),) or packed:
        raise ValueError(
            f"fed ids {fed.shape} for {len(tokens)} tokens of {len(order)} chunks: they "
            "feed one-token chunks, one id each, on the MLX forward only"
        )
    ids = fed.astype(mx.int32)[mx.array(np.asarray(order, dtype=np.int32))]
    if not padding:
        return ids
    return mx.concatenate([ids, mx.zeros((padding,), dtype=mx.int32)])


def _kernel_rows(
    chunks: Sequence[ChunkInput], order: list[int], positions: list[int], bs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row attends to the keys up to its own position through its chunk's table:
    a prefill row is a decode row of a shorter sequence."""
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


def _decode_groups(
    chunks: Sequence[ChunkInput], decodes: list[int], bs: int, lanes: int, num_kv_heads: int
) -> list[DecodeGroup]:
    lengths = [chunks[i].start + 1 for i in decodes]
    groups = []
    for a, b, lane in split_for_lanes(lengths, group_decodes(lengths), lanes):
        tables = [list(chunks[decodes[j]].block_table[: -(-lengths[j] // bs)]) for j in range(a, b)]
        groups.append(
            make_decode_group(
                a,
                tables,
                lengths[a:b],
                block_size=bs,
                num_kv_heads=num_kv_heads,
                lane=lane,
            )
        )
    return groups


def _prefill_chunks(
    chunks: Sequence[ChunkInput],
    prefills: list[int],
    first_rows: dict[int, int],
    bs: int,
    bucketed: bool,
) -> list[PrefillChunk]:
    return [
        make_prefill_chunk(
            first_rows[i],
            chunks[i].start,
            len(chunks[i].token_ids),
            list(chunks[i].block_table),
            block_size=bs,
            bucketed=bucketed,
        )
        for i in prefills
    ]
