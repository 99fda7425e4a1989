"""How far an 8-bit KV cache may move the engine's logprobs from mlx-lm's, by BLAS.

The engine multiplies packed, padded batches; mlx-lm, the oracle, one request at a
time, so their products round differently in the last bits. Float parity absorbs that;
an 8-bit KV cache does not always: a K/V value that lands on the other side of a
rounding boundary of the grid moves a whole level, and a few logprobs drift by a few
thousandths. How often depends on the BLAS kernels: with OpenBLAS's SkylakeX ones
(AVX-512 CPUs) the bounds below held; with the Haswell ones (AVX2-only CPUs, and
Zen 4, where batchd asks for them for speed) more values cross, and the same tests
measured a 95th-percentile gap of 1.3e-4 and a largest of 2.5e-3 on a Zen 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchd.engine.blas import loaded_core


@dataclass(frozen=True)
class QuantizedGap:
    """Bounds of |engine logprob - mlx-lm logprob| with an 8-bit KV cache."""

    p95: float  # the 95th percentile of a run's gaps
    largest: float  # any one gap
    each: float  # one logprob compared alone (pytest.approx's abs)


def quantized_gap() -> QuantizedGap:
    """The bounds for the kernels this process's OpenBLAS runs."""
    if loaded_core() == "SkylakeX":
        return QuantizedGap(p95=5e-5, largest=2e-3, each=2e-3)
    return QuantizedGap(p95=3e-4, largest=6e-3, each=6e-3)
