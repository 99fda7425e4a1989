"""Quantized products by row count on a GPU: is a new row count a compilation?

Run on a machine where MLX runs on CUDA (config/gpu/run_checks.sh runs it):
``python3 -m batchd.daemon.bench.gpu.shape_probe``. For SmolLM2-135M's widest product
(576 x 1536, 4-bit, groups of 32, as its GGUF converts) and for the same product dense
in float16, it times the first call at each row count a continuous batch passes through
and a repeat, so a first call far slower than its repeat is a kernel built for that shape.
"""

from __future__ import annotations

import time

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

ROWS = [1, 2, 3, 5, 8, 13, 16, 21, 33, 47, 64, 100, 257, 512]
IN, OUT, BITS, GROUP = 576, 1536, 4, 32


def _ms(run: object) -> float:
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(run())  # type: ignore[operator]
    mx.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    weight = mx.random.normal((OUT, IN)).astype(mx.float16)
    codes, scales, biases = mx.quantize(weight, group_size=GROUP, bits=BITS)
    mx.eval(weight, codes, scales, biases)
    print("rows  q4 first ms  q4 again ms  f16 first ms  f16 again ms")
    for rows in ROWS:
        x = mx.random.normal((rows, IN)).astype(mx.float16)
        mx.eval(x)

        def quantized(x: mx.array = x) -> mx.array:
            return mx.quantized_matmul(
                x, codes, scales, biases, transpose=True, group_size=GROUP, bits=BITS
            )

        def dense(x: mx.array = x) -> mx.array:
            return x @ weight.T

        q_first, q_again = _ms(quantized), _ms(quantized)
        d_first, d_again = _ms(dense), _ms(dense)
        print(f"{rows:4} {q_first:12.2f} {q_again:12.2f} {d_first:13.2f} {d_again:13.2f}")


if __name__ == "__main__":
    main()
