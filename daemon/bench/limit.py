"""The limit: the tokens/s a workload's FLOPs allow at the machine's matmul rate.

The matrix-product rate is measured in the same run (a large float32
matmul, best of a few), so the limit moves with the machine's load like the
systems do. A workload's FLOPs count only what an ideal engine must compute:
every prompt position once (a shared prefix once in all), the linear layers
and attention for each position fed through the model, and the output head
only where a token is sampled. batchd's throughput over the limit is its
model-FLOPs utilisation (MFU).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.bench.workloads import Workload


def matmul_gflops(*, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a ``size`` x ``size`` float32 matrix product, best of ``repeats``."""
    a = mx.random.normal((size, size), key=mx.random.key(0))
    b = mx.random.normal((size, size), key=mx.random.key(1))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one llama-family forward, from the model's config.json."""

    linear_per_token: int  # all layers' projections and MLP, per position
    head_per_token: int  # the output head, per sampled token
    attention_per_key: int  # QK^T and AV over all layers, per (query, key) pair

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelFlops:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        layers = config["num_hidden_layers"]
        per_layer = (
            hidden * heads * head_dim * 2  # q and o projections
            + hidden * kv_heads * head_dim * 2  # k and v projections
            + hidden * config["intermediate_size"] * 3  # gate, up, down
        )
        return cls(
            linear_per_token=2 * layers * per_layer,
            head_per_token=2 * hidden * config["vocab_size"],
            attention_per_key=4 * layers * heads * head_dim,
        )

    @property
    def per_output_token(self) -> int:
        """FLOPs of one decode step, attention aside (the "~2 x params" figure)."""
        return self.linear_per_token + self.head_per_token

    def workload_flops(self, workload: Workload) -> int:
        """FLOPs an ideal engine spends on ``workload`` (shared prefix computed once)."""
        total = 0
        cached = 0
        for request in workload.requests:
            # Positions fed through the model: the prompt, then every output
            # but the last (its K/V is never needed).
            end = len(request.prompt_ids) + request.max_tokens - 1
            first = min(cached, len(request.prompt_ids) - 1)
            positions = end - first
            # Position p attends to p + 1 keys: sum over p in [first, end).
            keys = (end * (end + 1) - first * (first + 1)) // 2
            total += positions * self.linear_per_token
            total += keys * self.attention_per_key
            total += request.max_tokens * self.head_per_token
            cached = workload.shared_prefix_len
        return total


def limit_summary(flops: ModelFlops, workload: Workload, gflops: float) -> dict[str, Any]:
    """The workload's FLOPs and the output tokens/s they allow at ``gflops``."""
    work = flops.workload_flops(workload)
    seconds = work / (gflops * 1e9)
    return {
        "matmul_gflops": round(gflops, 1),
        "workload_gflop": round(work / 1e9, 2),
        "min_seconds": round(seconds, 3),
        "limit_tok_s": round(workload.output_tokens / seconds, 1),
    }
