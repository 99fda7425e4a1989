"""Prefill buckets (batchd.engine.forward.prefill_buckets): the sizes chunks pad to, and
where the padding is on. Their effect on tokens: tests/engine/test_parity.py."""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest

from batchd.engine.forward import prefill_buckets


@pytest.mark.parametrize(
    ("n", "multiple", "size"),
    [
        (1, 1, 16),
        (16, 1, 16),
        (17, 1, 32),
        (200, 16, 256),
        (8192, 1, 8192),
        (8193, 1, 16384),
        (70_000, 16, 73_728),
        (20, 32, 32),
    ],
)
def test_prefill_buckets_are_powers_of_two_then_multiples(n: int, multiple: int, size: int) -> None:
    """Sizes up to LARGEST_POWER pad to a power of two, beyond it to its multiple; keys
    to whole KV blocks."""
    assert prefill_buckets.bucket(n, multiple=multiple) == size


def test_buckets_are_on_where_mlx_runs_on_cuda_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(prefill_buckets.ENV, raising=False)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert prefill_buckets.enabled() == on_cuda
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv(prefill_buckets.ENV, value)
        assert prefill_buckets.enabled() is expected
