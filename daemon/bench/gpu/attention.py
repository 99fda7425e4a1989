"""Decode attention on a GPU: the CUDA paged kernel against the gather path, one layer.

Run on a machine where MLX runs on CUDA (config/gpu/run_checks.sh runs it):
``python3 -m batchd.daemon.bench.gpu.attention [--json FILE]``. For each batch and context it
times one layer's decode attention of an 8B Llama shape (32 heads, 8 KV heads, head dim
128, bfloat16, blocks of 16 tokens scattered through the pool) both ways, each the median
of timed repeats after a warm-up, and prints the time and the K/V bytes read per second
(the kernel's floor is those bytes over the card's memory bandwidth).
"""

from __future__ import annotations

import argparse
import json

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.daemon.bench.gpu.timing import median_ms
from batchd.engine.forward import cuda_paged
from batchd.engine.forward.paged_attention import decode_attention, make_decode_group

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
CASES = [(1, 2048), (16, 2048), (64, 1024), (64, 4096), (256, 1024)]
REPEATS = 20


def measure(batch: int, context: int, rng: np.random.Generator) -> dict[str, float]:
    """One case: both paths' times and the paged kernel's largest difference from gather."""
    per_row = -(-context // BLOCK)
    blocks = batch * per_row + 8
    shape = (KV_HEADS, blocks * BLOCK, DIM)
    k = mx.random.normal(shape).astype(mx.bfloat16)
    v = mx.random.normal(shape).astype(mx.bfloat16)
    q = mx.random.normal((batch, HEADS, DIM)).astype(mx.bfloat16)
    order = rng.permutation(blocks)[: batch * per_row].reshape(batch, per_row)
    lengths = [context] * batch
    tables = mx.array(order.astype(np.int32))
    lengths_array = mx.array(np.asarray(lengths, dtype=np.int32))
    scale = mx.array([DIM**-0.5], dtype=mx.float32)
    group = make_decode_group(0, order.tolist(), lengths, block_size=BLOCK, num_kv_heads=KV_HEADS)
    kb, vb = (a.reshape(KV_HEADS, blocks, BLOCK, DIM) for a in (k, v))

    def paged() -> mx.array:
        return cuda_paged.paged_decode(q, k, v, tables, lengths_array, scale, block_size=BLOCK)

    def gather() -> mx.array:
        return decode_attention(q, kb, vb, group, scale=DIM**-0.5)

    difference = mx.abs(paged().astype(mx.float32) - gather().astype(mx.float32)).max()
    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
    paged_ms, gather_ms = (median_ms(f, repeats=REPEATS, warmups=3) for f in (paged, gather))
    return {
        "batch": batch,
        "context": context,
        "paged_ms": paged_ms,
        "gather_ms": gather_ms,
        "speedup": gather_ms / paged_ms,
        "paged_gb_s": kv_bytes / paged_ms / 1e6,
        "max_abs_difference": float(np.array(difference)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = [measure(batch, context, rng) for batch, context in CASES]
    print(f"decode attention, one layer: {HEADS} heads, {KV_HEADS} KV heads, dim {DIM}, bf16")
    print("batch context  paged ms  gather ms  gather/paged  paged GB/s  max |diff|")
    for r in rows:
        print(
            f"{r['batch']:5} {r['context']:7} {r['paged_ms']:9.3f} {r['gather_ms']:10.3f} "
            f"{r['speedup']:13.2f} {r['paged_gb_s']:11.0f} {r['max_abs_difference']:11.2e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
