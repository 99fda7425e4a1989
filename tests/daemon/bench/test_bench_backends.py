"""The backends workload (batchd.daemon.bench.engine_system.compare_backends) on the tiny
model: every backend and sampler on the same requests, figures and the report's section."""

from __future__ import annotations

from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.daemon.bench.engine_system import (
    ASYNC_LABEL,
    BACKEND_CONFIGS,
    backends_headline,
    backends_lines,
    compare_backends,
)
from batchd.daemon.bench.workloads import SCALES, mixed
from batchd.engine import EngineConfig


def test_backends_workload_runs_every_pair_with_its_step_profile(tiny_model: Path) -> None:
    workload = mixed(scale=SCALES["tiny"], vocab_size=1024, seed=0)
    requests = workload.requests[:3]
    result = compare_backends(
        tiny_model, EngineConfig(max_num_seqs=4), requests, requests[:1], rounds=1
    )
    labels = {label for label, *_ in BACKEND_CONFIGS}
    assert set(result["systems"]) | set(result["skipped"]) == labels
    before, after = (result["systems"][label] for label, *_ in BACKEND_CONFIGS[:2])
    assert (before["backend"], before["sampler"]) == ("mlx", "host")
    assert (after["backend"], after["sampler"]) == ("mlx", "device")
    assert result["output_tokens"] == sum(r.max_tokens for r in requests)
    for figures in result["systems"].values():
        assert figures["tok_s"] > 0 and figures["decode_step_ms"] > 0
        # One wait a step, measured; building the sample rows happens before it.
        assert figures["device_wait_ms"] >= 0 and figures["host_hidden_ms"] >= 0
    assert result["mlx_speedup"] > 0 and result["async_speedup"] > 0
    assert result["systems"][ASYNC_LABEL]["sampler"] == "device" and result["async_same_tokens"]
    assert "MLX path" in backends_headline(result)
    lines = backends_lines(result)
    assert lines[0] == "## Forward backends and samplers"
    assert any(line.startswith("| mlx, device sampling (after)") for line in lines)
