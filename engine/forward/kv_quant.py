"""Quantized KV blocks: K and V stored as MLX's group-wise codes, scales and biases.

With ``EngineConfig.kv_bits`` set, each layer's K (and V) in the pool is the triple
``mx.quantize`` returns for ``[kv_heads, slots, head_dim]``: codes packed in uint32
``[kv_heads, slots, head_dim * bits / 32]``, and a scale and a bias per group of
``kv_group_size`` values ``[kv_heads, slots, head_dim / group]`` in the model's dtype:
the layout of mlx-lm's QuantizedKVCache, one token's head per row, so a token quantizes
the same whichever step or chunk wrote it.

Attention always reads K/V through one round trip (dequantize of the stored codes), the
fresh keys of a prompt's first chunk included: a token's output then never depends on
how its prompt was chunked or whether a prefix came from the cache, and it matches
mlx-lm run with a QuantizedKVCache from the first token. The gather path dequantizes
the blocks it gathers; the C attention kernel reads float pools only, so a quantized
pool runs on MLX's path (a kernel reading the codes in place is a later step).
"""

from __future__ import annotations

from dataclasses import dataclass

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

# The widths and groups EngineConfig accepts: MLX quantizes other widths too, but only
# these are measured (docs/performance.md, "KV-cache quantization").
from batchd.engine.config import KV_BITS, KV_GROUP_SIZES


@dataclass(frozen=True)
class KVQuant:
    """Group-wise quantization of the KV pool: ``bits`` per value, one scale and bias per
    ``group_size`` values of a head. Raises ValueError for widths or groups not supported."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv_bits={self.bits!r} is not supported: one of {KV_BITS}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(
                f"kv_group_size={self.group_size!r} is not supported: one of {KV_GROUP_SIZES}"
            )

    def check(self, head_dim: int) -> None:
        """Raise ValueError unless a head of ``head_dim`` values splits into whole groups."""
        if head_dim % self.group_size:
            fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
            raise ValueError(
                f"kv_group_size={self.group_size} does not divide the model's head_dim "
                f"{head_dim}: quantized KV needs whole groups per head (try one of {fits})"
                if fits
                else f"head_dim {head_dim} is not a multiple of any of {KV_GROUP_SIZES}: "
                "this model cannot use a quantized KV cache (set kv_bits to None)"
            )

    def row_bytes(self, head_dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one token's one head: codes plus a scale and a bias per group."""
        return head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * dtype.size

    def describe(self) -> str:
        return f"{self.bits}-bit KV (groups of {self.group_size})"


def from_options(bits: int | None, group_size: int) -> KVQuant | None:
    """The pool's quantization from EngineConfig.kv_bits / kv_group_size (None: float)."""
    return None if bits is None else KVQuant(bits, group_size)


Quantized = tuple[mx.array, mx.array, mx.array]
"""codes, scales, biases of K or V, as ``mx.quantize`` returns them."""


def zeros(quant: KVQuant, shape: tuple[int, int, int], dtype: mx.Dtype) -> Quantized:
    """Storage for ``shape`` = [kv_heads, slots, head_dim], all zero (reads as 0.0)."""
    heads, slots, dim = shape
    quant.check(dim)
    per_word = 32 // quant.bits
    groups = dim // quant.group_size
    return (
        mx.zeros((heads, slots, dim // per_word), dtype=mx.uint32),
        mx.zeros((heads, slots, groups), dtype=dtype),
        mx.zeros((heads, slots, groups), dtype=dtype),
    )


def quantize(quant: KVQuant, values: mx.array) -> Quantized:
    """``values`` [..., head_dim] as codes, scales and biases (in ``values``' dtype)."""
    codes, scales, biases = mx.quantize(values, group_size=quant.group_size, bits=quant.bits)
    return codes, scales, biases


def round_trip(quant: KVQuant, values: mx.array) -> mx.array:
    """``values`` as attention reads them back from the pool."""
    return dequantize(quant, quantize(quant, values))


def dequantize(quant: KVQuant, stored: Quantized) -> mx.array:
    codes, scales, biases = stored
    return mx.dequantize(codes, scales, biases, group_size=quant.group_size, bits=quant.bits)


@dataclass(frozen=True)
class QuantizedBlocks:
    """One layer's quantized K or V viewed as blocks: each array
    ``[kv_heads, num_blocks, block_size, *]``."""

    quant: KVQuant
    stored: Quantized

    def take(self, index: mx.array) -> mx.array:
        """Blocks ``index`` (any shape of block ids) dequantized:
        ``[kv_heads, *index.shape, block_size, head_dim]``."""
        codes, scales, biases = self.stored
        return dequantize(self.quant, (codes[:, index], scales[:, index], biases[:, index]))

    def round_trip(self, values: mx.array) -> mx.array:
        """Fresh ``values`` as these blocks hold them once written (in ``values``' dtype)."""
        stored = values.astype(self.stored[1].dtype)
        return round_trip(self.quant, stored).astype(values.dtype)


Blocks = mx.array | QuantizedBlocks
"""One layer's K or V as blocks ``[kv_heads, num_blocks, block_size, head_dim]``: the float
array itself, or its quantized form."""


def take_blocks(blocks: Blocks, index: mx.array) -> mx.array:
    """Blocks ``index`` of either kind as floats: ``[kv_heads, *index.shape, block_size, D]``."""
    if isinstance(blocks, QuantizedBlocks):
        return blocks.take(index)
    return blocks[:, index]
