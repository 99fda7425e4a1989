"""batchd's engine as a step system (see batchd.daemon.bench.drive)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from batchd.daemon.bench.workloads import Request
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.outputs import StepStats


def bench_engine_config(
    engine: EngineConfig, *, longest_request: int, max_prefill_tokens_with_decodes: int | None
) -> EngineConfig:
    """batchd's engine options for one run: ``engine`` as given, field by field, with the
    run's prefill bound (the throughput setting, or the online workloads' latency one)
    and, where ``engine.num_kv_blocks`` is unset, a KV pool that holds every running
    sequence whole.

    That pool is sized from the workload, not from free memory, so that the run does
    the same work on any machine (no preemption), and BatchGenerator (whose caches grow
    as needed) is not handicapped by comparison.
    """
    blocks = engine.num_kv_blocks
    if blocks is None:
        blocks_per_seq = -(-longest_request // engine.block_size) + 1
        blocks = engine.max_num_seqs * blocks_per_seq + 64
    return dataclasses.replace(
        engine,
        max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        num_kv_blocks=blocks,
    )


class BatchdSystem:
    """One LLMEngine, fed greedy requests that ignore EOS and run to max_tokens."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        self.engine = LLMEngine.from_pretrained(str(model_path), config)
        self.steps: list[StepStats] = []  # every step's figures, for the online step profile

    def add(self, request: Request) -> None:
        self.engine.add_request(
            request.request_id,
            prompt_token_ids=request.prompt_ids,
            params=SamplingParams(max_tokens=request.max_tokens, ignore_eos=True),
        )

    def step(self) -> list[tuple[str, int, bool]]:
        outputs = self.engine.step()
        self.steps.append(self.engine.last_step_stats)
        return [(out.request_id, 1, out.finished) for out in outputs]

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished())

    def close(self) -> None:
        """Nothing to release: the engine owns no threads or files."""


# -- the backends workload: the MLX path before and after, the C path, same run -------------

# (label, forward_backend, sampler, async_scheduling): "before" is the MLX path as it was,
# sampling on the host; the async row launches each decode step before the previous one is
# read (batchd.engine.async_step); the native_cpu rows check the C path (and which sampler
# it should keep).
ASYNC_LABEL = "mlx, device sampling, async scheduling"
BACKEND_CONFIGS = (
    ("mlx, host sampling (before)", "mlx", "host", False),
    ("mlx, device sampling (after)", "mlx", "device", False),
    (ASYNC_LABEL, "mlx", "device", True),
    ("native_cpu, host sampling", "native_cpu", "host", False),
    ("native_cpu, device sampling", "native_cpu", "device", False),
)


def backend_requests(requests: list[Request]) -> list[tuple[Request, SamplingParams]]:
    """The workload's requests, every other one sampled (seeded, temperature 0.8, top-p
    0.95) so that the samplers' work is measured too, not greedy argmax alone."""
    return [
        (
            r,
            SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i
            ),
        )
        for i, r in enumerate(requests)
    ]


def _run_round(
    engine: LLMEngine, requests: list[tuple[Request, SamplingParams]]
) -> tuple[float, dict[str, list[int]], list[StepStats]]:
    """All requests at t=0, to the end: seconds, tokens by request, every step's figures."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in requests}
    steps: list[StepStats] = []
    start = time.perf_counter()
    for r, params in requests:
        engine.add_request(r.request_id, prompt_token_ids=r.prompt_ids, params=params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
        steps.append(engine.last_step_stats)
    return time.perf_counter() - start, tokens, steps


def compare_backends(
    model_path: Path,
    engine: EngineConfig,
    requests: list[Request],
    warm: list[Request],
    *,
    rounds: int,
) -> dict[str, Any]:
    """Each available backend/sampler pair on the same requests, ``rounds`` alternating
    rounds (a slow spell of the host falls on all); median round's tokens/s, the step
    profile of the decode-only steps (host time hidden under device time, time waiting
    for the device), and whether each pair's tokens equal the MLX path's before."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests + warm)
    base = bench_engine_config(
        engine,
        longest_request=longest,
        max_prefill_tokens_with_decodes=engine.max_prefill_tokens_with_decodes,
    )
    engines: dict[str, LLMEngine] = {}
    skipped: dict[str, str] = {}
    for label, backend, sampler, pipelined in BACKEND_CONFIGS:
        config = dataclasses.replace(
            base, forward_backend=backend, sampler=sampler, async_scheduling=pipelined
        )
        try:
            engines[label] = LLMEngine.from_pretrained(str(model_path), config)
        except ValueError as exc:  # native_cpu where the C kernels cannot run
            skipped[label] = str(exc)
    batch = backend_requests(requests)
    for e in engines.values():  # first-call costs out of the figures
        _run_round(e, backend_requests(warm))
    seconds: dict[str, list[float]] = {label: [] for label in engines}
    profiles: dict[str, list[StepStats]] = {label: [] for label in engines}
    outputs: dict[str, dict[str, list[int]]] = {}
    order = list(engines)
    for i in range(rounds):
        for label in order if i % 2 == 0 else reversed(order):
            took, tokens, steps = _run_round(engines[label], batch)
            seconds[label].append(took)
            profiles[label] += steps
            outputs.setdefault(label, tokens)
    before = BACKEND_CONFIGS[0][0]
    total = sum(len(t) for t in outputs[before].values())
    result: dict[str, Any] = {
        "requests": len(batch),
        "output_tokens": total,
        "rounds": rounds,
        "skipped": skipped,
        "systems": {},
    }
    for label, e in engines.items():
        median = statistics.median(seconds[label])
        result["systems"][label] = {
            "backend": e.backend.name,
            "sampler": e.backend.sampler,
            "seconds": [round(s, 3) for s in seconds[label]],
            "median_s": round(median, 3),
            "tok_s": round(total / median, 2),
            "same_tokens_as_before": outputs[label] == outputs[before],
            **overlap_profile(profiles[label]),
        }
    systems = result["systems"]
    after = BACKEND_CONFIGS[1][0]
    result["mlx_speedup"] = round(systems[after]["tok_s"] / systems[before]["tok_s"], 3)
    result["async_speedup"] = round(systems[ASYNC_LABEL]["tok_s"] / systems[after]["tok_s"], 3)
    result["async_same_tokens"] = outputs[ASYNC_LABEL] == outputs[after]
    return result


def overlap_profile(steps: list[StepStats]) -> dict[str, float]:
    """Means over the decode-only steps: step time, host time spent while the device
    computed (hidden), and time the host then waited for the device."""
    decode = [s for s in steps if s.num_decode_tokens and not s.num_prefill_tokens] or steps
    n = len(decode) or 1
    return {
        "decode_step_ms": round(1000 * sum(s.step_time_s for s in decode) / n, 3),
        "host_hidden_ms": round(1000 * sum(s.host_overlap_s for s in decode) / n, 3),
        "device_wait_ms": round(1000 * sum(s.sync_wait_s for s in decode) / n, 3),
    }


def backends_headline(result: dict[str, Any]) -> str:
    return (
        f"MLX path {result['mlx_speedup']:.2f}x with device sampling, "
        f"{result['async_speedup']:.2f}x more with async scheduling (same run)"
    )


def backends_lines(result: dict[str, Any]) -> list[str]:
    """The report's markdown section."""
    lines = [
        "## Forward backends and samplers",
        "",
        f"{result['requests']} requests (every other one seeded, temperature 0.8, top-p 0.95), "
        f"{result['output_tokens']} tokens, median of {result['rounds']} alternating rounds; "
        "step figures are means over the decode-only steps (host hidden: host work done "
        "while the device computed; device wait: the one sync).",
        "",
        "| backend, sampler | tok/s | decode step ms | host hidden ms | device wait ms "
        "| same tokens as before |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in result["systems"].items():
        lines.append(
            f"| {label} | {s['tok_s']:.1f} | {s['decode_step_ms']:.2f} | "
            f"{s['host_hidden_ms']:.2f} | {s['device_wait_ms']:.2f} | "
            f"{s['same_tokens_as_before']} |"
        )
    for label, why in result["skipped"].items():
        lines.append(f"| {label} | skipped: {why} | | | | |")
    lines += [
        "",
        f"MLX path after / before: {result['mlx_speedup']:.2f}x; async scheduling on / off "
        f"(device sampling): {result['async_speedup']:.2f}x, same tokens: "
        f"{result['async_same_tokens']}.",
    ]
    return lines
