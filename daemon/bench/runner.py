"""The benchmark run: limit, workloads, peers, report — in one process, minutes apart."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.bench import queue
from batchd.daemon.bench.engine_system import backends_headline
from batchd.daemon.bench.limit import ModelFlops, limit_summary, matmul_gflops
from batchd.daemon.bench.online import run_online, saturation_rate
from batchd.daemon.bench.peak import (
    FLOPS_FORMULA,
    Peak,
    device_name,
    on_gpu,
    peak_figures,
    resolve_peak,
)
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.speculative import run_speculative, speculative_headline
from batchd.daemon.bench.sweep import (
    DEFAULT_BOUNDS,
    DEFAULT_ROUNDS,
    run_online_sweep,
    sweep_headline,
)
from batchd.daemon.bench.systems import (
    BATCHD,
    BATCHGEN,
    LABELS,
    OFFLINE_ORDER,
    SEQUENTIAL,
    STATIC,
    Systems,
    SystemSettings,
    SystemUnavailable,
)
from batchd.daemon.bench.workloads import (
    THROUGHPUT_WORKLOADS,
    Scale,
    Workload,
    mixed,
    shared_prefix,
)
from batchd.engine.blas import cpu_description, loaded_core, loaded_openblas
from batchd.engine.config import EngineConfig

WORKLOADS = ("mixed", "shared-prefix", "online", "queue")
# The systems of each throughput workload. Static batching runs on mixed only: its
# padded waves and barrier show there; on shared-prefix (every prompt ~the same length)
# it only repeats BatchGenerator's figure, at ~3 minutes of a SmolLM2 run.
OFFLINE_SYSTEMS = {
    "mixed": OFFLINE_ORDER,
    "shared-prefix": tuple(key for key in OFFLINE_ORDER if key != STATIC),
}
# Run only when asked for by name (not part of a full run): see batchd.daemon.bench.sweep
# and batchd.daemon.bench.speculative.
EXTRA_WORKLOADS = ("online-sweep", "speculative", "backends")

# batchd's max_prefill_tokens_with_decodes in the online workload: a latency setting (every
# running decode waits for the prefill tokens its step carries). 4 was the one bound that
# kept ITL p99/p50 within the target with TTFT p99 under BatchGenerator's in the online sweeps
# (docs/bench/HISTORY.md, "The prefill bound's trade"); rerun `batchd bench online-sweep`
# when decode steps change length. The throughput workloads keep the engine settings'
# value (default: no bound).
ONLINE_MAX_PREFILL_TOKENS = 4


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark run's settings (the CLI fills these; tests shrink ``scale``)."""

    model_path: Path
    model_label: str
    workloads: tuple[str, ...]
    scale: Scale
    # batchd's engine, every option as set (the settings' engine section, --max-num-seqs
    # on top); per run the bench sets only the prefill bound and, unless given, the pool.
    engine: EngineConfig
    redis_url: str
    seed: int = 0
    online_load: float = 0.9
    online_max_prefill_tokens_with_decodes: int | None = ONLINE_MAX_PREFILL_TOKENS
    sweep_bounds: tuple[int | None, ...] = DEFAULT_BOUNDS
    sweep_rounds: int = DEFAULT_ROUNDS
    queue_rounds: int | None = (
        None  # None: as many as batchd.daemon.bench.queue's time budget allows
    )
    # The queue workload's daemons, and the partitions of its queue ([queue] partitions).
    queue_daemons: int = 1
    queue_partitions: int = 1
    # The queue workload's requests (None: the scale's short_requests): enough of them to
    # keep many sequences per daemon running, for the Redis side's cost per token.
    queue_requests: int | None = None
    command: str = ""
    # The speculative workload: the method compared with off, and its draft model.
    speculative_method: str = "ngram"
    speculative_draft_model: str | None = None
    # The device's peak TFLOP/s for MFU of peak (None: batchd.daemon.bench.peak's table
    # on a GPU it knows, else no MFU of peak).
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        known = WORKLOADS + EXTRA_WORKLOADS
        unknown = set(self.workloads) - set(known)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {known}")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "device": str(mx.default_device()),
        "device_name": device_name(),
        "blas": loaded_openblas() or ("Accelerate" if sys.platform == "darwin" else "bundled"),
        "blas_kernels": loaded_core(),
    }


def run_bench(options: BenchOptions, progress: Progress) -> dict[str, Any]:
    """Run the selected workloads; returns the full report (see batchd.daemon.bench.report)."""
    config = json.loads((options.model_path / "config.json").read_text())
    flops = ModelFlops.from_model_dir(options.model_path)
    progress.phase("limit: timing a float32 matmul")
    gflops = matmul_gflops(size=options.scale.matmul_size)
    progress.say(f"matmul rate {gflops:.0f} GFLOP/s")
    machine = machine_info()
    peak = resolve_peak(options.peak_tflops, machine["device_name"], gpu=on_gpu())
    systems = Systems(
        SystemSettings(
            model_path=options.model_path,
            engine=options.engine,
            scale=options.scale,
            vocab_size=config["vocab_size"],
            online_max_prefill_tokens_with_decodes=options.online_max_prefill_tokens_with_decodes,
        ),
        progress,
    )
    report: dict[str, Any] = {
        "settings": {
            "model": str(options.model_path),
            "model_label": options.model_label,
            "dtype": config.get("torch_dtype"),
            # A GGUF kept quantized (the default on Metal): its weights' bits.
            "weight_bits": (config.get("quantization") or {}).get("bits"),
            "max_num_seqs": options.engine.max_num_seqs,
            "max_num_batched_tokens": options.engine.max_num_batched_tokens,
            "max_prefill_tokens_with_decodes": options.engine.max_prefill_tokens_with_decodes,
            "online_max_prefill_tokens_with_decodes": (
                options.online_max_prefill_tokens_with_decodes
            ),
            "prefill_fills_row_tile": options.engine.prefill_fills_row_tile,
            "engine": dataclasses.asdict(options.engine),
            "scale": options.scale.name,
            "seed": options.seed,
            "workloads": list(options.workloads),
            "online_load": options.online_load,
            "sweep_bounds": list(options.sweep_bounds),
            "sweep_rounds": options.sweep_rounds,
            "queue_rounds": options.queue_rounds,
            "command": options.command,
        },
        "machine": machine,
        "limit": {
            "matmul_gflops": round(gflops, 1),
            "matmul_size": options.scale.matmul_size,
            "mflop_per_output_token": round(flops.per_output_token / 1e6, 2),
            "mflop_per_prompt_token": round(flops.linear_per_token / 1e6, 2),
            "mflop_per_attended_key": round(flops.attention_per_key / 1e6, 4),
            "flops_formula": FLOPS_FORMULA,
            "peak_tflops": peak.tflops if peak else None,
            "peak_source": peak.source if peak else None,
        },
        "workloads": {},
    }
    vocab = config["vocab_size"]
    workloads = {
        "mixed": mixed(scale=options.scale, vocab_size=vocab, seed=options.seed),
        "shared-prefix": shared_prefix(scale=options.scale, vocab_size=vocab, seed=options.seed),
    }
    short_mixed = workloads["mixed"].subset(options.scale.short_requests)
    results = report["workloads"]
    for name in THROUGHPUT_WORKLOADS:
        if name in options.workloads:
            results[name] = offline_workload(
                systems,
                workloads[name],
                OFFLINE_SYSTEMS[name],
                flops=flops,
                scale=options.scale,
                peak=peak,
            )
    if "online" in options.workloads:
        results["online"] = online_workload(systems, short_mixed, options, results)
    if "online-sweep" in options.workloads:
        rate, _, _ = online_rate(systems, short_mixed, options, results)
        results["online-sweep"] = run_online_sweep(
            systems,
            short_mixed,
            rate=rate,
            seed=options.seed,
            bounds=options.sweep_bounds,
            rounds=options.sweep_rounds,
        )
    if "queue" in options.workloads:
        results["queue"] = queue.run_queue(
            systems,
            _queue_requests(options, vocab) or short_mixed,
            redis_url=options.redis_url,
            progress=progress,
            rounds=options.queue_rounds,
            daemons=options.queue_daemons,
            partitions=options.queue_partitions,
        )
    if "speculative" in options.workloads:
        results["speculative"] = run_speculative(
            model_path=options.model_path,
            engine=options.engine,
            scale=options.scale,
            vocab_size=vocab,
            seed=options.seed,
            progress=progress,
            method=options.speculative_method,
            draft_model=options.speculative_draft_model,
        )
    if "backends" in options.workloads:
        results["backends"] = systems.backends(workloads["mixed"])
    report["headline"] = headline(report)
    return report


def offline_workload(
    systems: Systems,
    workload: Workload,
    keys: tuple[str, ...],
    *,
    flops: ModelFlops,
    scale: Scale,
    peak: Peak | None = None,
) -> dict[str, Any]:
    """Every system on ``workload`` (sequential on a subset); throughput ratios and MFU.

    The matmul rate is measured again right before the workload, so the limit
    reflects the machine's load at the time the systems run. Each system's model
    GFLOP/s (and MFU of ``peak``, if known) count the requests it ran.
    """
    limit = limit_summary(flops, workload, matmul_gflops(size=scale.matmul_size))
    result: dict[str, Any] = {
        "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "params": workload.params,
        "limit": limit,
        "systems": {},
        "unavailable": {},
    }
    for key in keys:
        part = workload.subset(_requests_for(key, workload, scale))
        try:
            stats = systems.offline(key, part)
        except SystemUnavailable as exc:
            result["unavailable"][key] = str(exc)
            continue
        summary = stats.summary()
        summary["mfu"] = round(summary["tok_s"] / limit["limit_tok_s"], 4)
        summary |= peak_figures(flops, part, stats.wall_s, peak)
        result["systems"][key] = {"label": LABELS[key], **summary}
    done = result["systems"]
    if BATCHD in done:
        result["ratios"] = {
            f"vs_{key}": round(done[BATCHD]["tok_s"] / done[key]["tok_s"], 3)
            for key in done
            if key != BATCHD and done[key]["tok_s"] > 0
        }
    return result


def _requests_for(key: str, workload: Workload, scale: Scale) -> int:
    """How many of ``workload``'s requests system ``key`` runs (see Scale)."""
    if key == SEQUENTIAL:
        return scale.sequential_requests
    if key == STATIC:
        return scale.short_requests
    return len(workload.requests)


def online_rate(
    systems: Systems, workload: Workload, options: BenchOptions, results: dict[str, Any]
) -> tuple[float, dict[str, Any], bool]:
    """Requests/s at ``online_load`` times BatchGenerator's mixed throughput, the figures
    it came from, and whether they were measured now (on ``workload``: this run has no
    mixed figure)."""
    peer = results.get("mixed", {}).get("systems", {}).get(BATCHGEN)
    probed = peer is None
    if peer is None:
        peer = systems.offline(BATCHGEN, workload).summary()
    rate = saturation_rate(peer_tok_s=peer["tok_s"], workload=workload, load=options.online_load)
    return rate, peer, probed


def online_workload(
    systems: Systems, workload: Workload, options: BenchOptions, results: dict[str, Any]
) -> dict[str, Any]:
    """Poisson arrivals at ``online_load`` times BatchGenerator's mixed throughput."""
    rate, peer, probed = online_rate(systems, workload, options, results)
    result = run_online(systems, workload, rate=rate, load=options.online_load, seed=options.seed)
    result["rate_from_tok_s"] = peer["tok_s"]
    if probed:
        result["saturation_probe"] = peer
    return result


def headline(report: dict[str, Any]) -> str:
    """The one line that says it all, e.g. ``mixed 1.62x BatchGenerator, 4.1x sequential; ...``."""
    parts = []
    results = report["workloads"]
    for name in THROUGHPUT_WORKLOADS:
        if name not in results:
            continue
        ratios = results[name].get("ratios")
        if ratios is None:
            parts.append(f"{name}: batchd {results[name]['unavailable'].get(BATCHD)}")
            continue
        figures = [
            f"{ratios[f'vs_{key}']:.2f}x {LABELS[key].removeprefix('mlx-lm ')}"
            for key in OFFLINE_ORDER
            if f"vs_{key}" in ratios
        ]
        parts.append(f"{name} " + ", ".join(figures) + _peak_shares(results[name]["systems"]))
    online = results.get("online")
    if online is not None and "ratios" in online:
        ours, peer = online["systems"][BATCHD], online["systems"][BATCHGEN]
        parts.append(
            f"online TTFT p50 {ours['ttft_p50_s']:.2f}s vs {peer['ttft_p50_s']:.2f}s, "
            f"p99 {ours['ttft_p99_s']:.2f}s vs {peer['ttft_p99_s']:.2f}s BatchGenerator"
        )
    elif online is not None:
        parts.append(f"online: batchd {online['unavailable'].get(BATCHD)}")
    q = results.get("queue")
    if q is not None:
        parts.append(
            f"queue {q['ratio']:.2f}x in-process" if q.get("available") else f"queue {q['reason']}"
        )
    sweep = results.get("online-sweep")
    if sweep is not None:
        parts.append(sweep_headline(sweep))
    spec = results.get("speculative")
    if spec is not None:
        parts.append(speculative_headline(spec))
    if "backends" in results:
        parts.append(backends_headline(results["backends"]))
    return "; ".join(parts)


def _peak_shares(systems: dict[str, Any]) -> str:
    """batchd's and BatchGenerator's MFU of the device's peak, where the run has one."""
    ours, peer = systems.get(BATCHD, {}), systems.get(BATCHGEN, {})
    if "mfu_peak" not in ours or "mfu_peak" not in peer:
        return ""
    return f" (MFU of peak {ours['mfu_peak']:.2%} vs {peer['mfu_peak']:.2%})"


def _queue_requests(options: BenchOptions, vocab_size: int) -> Workload | None:
    """The queue workload's ``queue_requests`` mixed requests, where set (the first ones
    of a mixed workload that size, so a smaller count is a prefix of a larger one)."""
    count = options.queue_requests
    if count is None:
        return None
    scale = dataclasses.replace(options.scale, num_requests=max(count, options.scale.num_requests))
    return mixed(scale=scale, vocab_size=vocab_size, seed=options.seed).subset(count)
