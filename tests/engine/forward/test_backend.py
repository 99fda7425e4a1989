"""The forward backend chosen at start (batchd.engine.forward.backend): what auto takes,
why, which sampler it feeds, and what is refused."""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest

from batchd.engine import EngineConfig
from batchd.engine.forward import native, prefill_buckets
from batchd.engine.forward.backend import choose


def test_switched_off_kernels_give_mlx_sampling_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    choice = choose("auto", dtype=mx.float32)
    assert (choice.name, choice.sampler) == ("mlx", "device")
    assert f"{native.DISABLE_ENV}=0" in choice.reason
    with pytest.raises(ValueError, match="native_cpu cannot run here"):
        choose("native_cpu", dtype=mx.float32)


def test_what_the_kernels_do_not_cover_runs_on_mlx() -> None:
    for problem, options in (
        ("float32", {"dtype": mx.bfloat16}),
        ("quantized KV", {"dtype": mx.float32, "quantized_kv": True}),
        ("mlx-lm's own forward", {"dtype": mx.float32, "generic": True}),
    ):
        choice = choose("auto", **options)  # type: ignore[arg-type]
        assert choice.name == "mlx", problem
        assert choice.sampler == "device"


def test_the_mlx_backend_names_its_bucketed_prefill_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where prefill buckets are on (CUDA, or asked for) the mlx backend takes them and
    says so in its line; the generic path and the C kernels have no prefill chunks."""
    monkeypatch.setenv(prefill_buckets.ENV, "1")
    choice = choose("mlx", dtype=mx.float32)
    assert choice.prefill_buckets and "prefill attention at bucketed shapes" in choice.describe()
    assert not choose("mlx", dtype=mx.float32, generic=True).prefill_buckets
    monkeypatch.setenv(prefill_buckets.ENV, "0")
    choice = choose("mlx", dtype=mx.float32)
    assert not choice.prefill_buckets and "bucketed" not in choice.describe()


@pytest.mark.skipif(not native.available(), reason="no C compiler for the kernels here")
def test_auto_takes_the_kernels_on_this_cpu_and_samples_on_the_host() -> None:
    choice = choose("auto", dtype=mx.float32)
    assert (choice.name, choice.sampler) == ("native_cpu", "host")
    assert choose("auto", "device", dtype=mx.float32).sampler == "device"
    assert choose("mlx", dtype=mx.float32).describe().startswith("mlx (sampling on the device)")


def test_unknown_backends_and_samplers_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="forward_backend"):
        EngineConfig(forward_backend="gpu")
    with pytest.raises(ValueError, match="sampler"):
        EngineConfig(sampler="numpy")
    with pytest.raises(ValueError, match="expected one of"):
        choose("metal", dtype=None)
