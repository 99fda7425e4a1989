"""Prefill attention at a few shapes: each chunk's queries and keys padded to a bucket.

MLX's CUDA backend runs float16/bfloat16 prefill attention through cuDNN, and builds a
cuDNN graph for every new combination of query, key and mask shapes (kept in an LRU of
256, ``MLX_CUDA_SDPA_CACHE_SIZE``). A continuous batch's prefill chunks come in every
length, at every prefix length, so nearly every step met a new shape and paid for a
graph build. Padding a chunk's queries and keys up to a power of two (from 16;
multiples of LARGEST_POWER beyond it) bounds the shapes to a few dozen, each built once;
padded keys are masked, padded query rows attend to key 0 alone and are dropped
(batchd.engine.forward.paged_attention). The extra work is attention's only, and at
most double it. Figures: docs/bench/HISTORY.md, "Figures behind the code's choices".

On by default where MLX runs on CUDA; ``BATCHD_PREFILL_BUCKETS=1`` turns it on
anywhere (the tests' CPU runs), ``=0`` off.
"""

from __future__ import annotations

import os

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

ENV = "BATCHD_PREFILL_BUCKETS"
SMALLEST = 16
# Beyond this size buckets are its multiples, not powers of two: a 70k-token prefix pads
# to 73,728 keys, not 131,072 (at most 15 more shapes up to 128k keys).
LARGEST_POWER = 8192


def enabled() -> bool:
    """Whether prefill chunks are padded to buckets here (see the module's docstring)."""
    asked = os.environ.get(ENV)
    if asked in ("0", "1"):
        return asked == "1"
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def bucket(n: int, *, multiple: int = 1) -> int:
    """The padded size of ``n`` rows or keys: the power of two at or above it (at least
    SMALLEST; above LARGEST_POWER, the multiple of LARGEST_POWER), rounded up to
    ``multiple`` (a KV block's tokens for keys)."""
    if n > LARGEST_POWER:
        size = -(-n // LARGEST_POWER) * LARGEST_POWER
    else:
        size = max(SMALLEST, 1 << (n - 1).bit_length())
    return -(-size // multiple) * multiple
