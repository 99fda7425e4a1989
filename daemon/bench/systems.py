"""Every system of the benchmark behind one call: warm up, then measure.

Each measurement starts with a warm-up on a few unrelated short requests
(first-call costs: allocations, kernels, lazy imports), then times the
workload with a fresh Recorder. batchd and BatchGenerator run through the
same drive loop; sequential and static batching have their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.bench import peers
from batchd.daemon.bench.drive import StepSystem, run_offline, run_timed
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.stats import Recorder, RunStats, step_profile
from batchd.daemon.bench.workloads import Scale, Workload, warmup
from batchd.engine.config import EngineConfig
from batchd.engine.outputs import StepStats

BATCHD = "batchd"
BATCHGEN = "batchgen"
SEQUENTIAL = "sequential"
STATIC = "static"
LABELS = {
    BATCHD: "batchd",
    BATCHGEN: "mlx-lm BatchGenerator",
    SEQUENTIAL: "mlx-lm sequential",
    STATIC: "static batching",
}
STEP_SYSTEMS = (BATCHD, BATCHGEN)
OFFLINE_ORDER = (BATCHD, BATCHGEN, STATIC, SEQUENTIAL)


class SystemUnavailable(RuntimeError):
    """A system that cannot run here (e.g. the engine is not installed); says why."""


@dataclass(frozen=True)
class SystemSettings:
    """What every system shares: the model, and batchd's engine options (whose running
    cap is also the peers' batch size).

    batchd's prefill bound while decoding differs by run: throughput runs (every
    request at t=0) use ``engine.max_prefill_tokens_with_decodes``, timed (online)
    runs the latency setting ``online_max_prefill_tokens_with_decodes``.
    """

    model_path: Path
    engine: EngineConfig
    scale: Scale
    vocab_size: int
    online_max_prefill_tokens_with_decodes: int | None = None


class Systems:
    """Loads mlx-lm's model once; builds each step system on demand."""

    def __init__(self, settings: SystemSettings, progress: Progress) -> None:
        self.settings = settings
        self.progress = progress
        self.model: Any = peers.load_model(settings.model_path)

    def batchd_unavailable(self) -> str | None:
        """Why batchd's engine cannot run here, or None when it can."""
        try:
            from batchd.daemon.bench import engine_system  # noqa: F401
        except ImportError as exc:
            return f"engine not available: {exc}"
        return None

    def _step_system(
        self, key: str, longest_request: int, *, prefill_bound: int | None
    ) -> StepSystem:
        if key == BATCHGEN:
            return peers.BatchGeneratorSystem(
                self.model, completion_batch_size=self.settings.engine.max_num_seqs
            )
        reason = self.batchd_unavailable()
        if reason is not None:
            raise SystemUnavailable(reason)
        from batchd.daemon.bench.engine_system import BatchdSystem, bench_engine_config

        config = bench_engine_config(
            self.settings.engine,
            longest_request=longest_request,
            max_prefill_tokens_with_decodes=prefill_bound,
        )
        return BatchdSystem(self.settings.model_path, config)

    def warmup_for(self, workload: Workload) -> Workload:
        """The warm-up requests that go before ``workload``."""
        longest = max(len(r.prompt_ids) for r in workload.requests)
        return warmup(
            scale=self.settings.scale, vocab_size=self.settings.vocab_size, longest_prompt=longest
        )

    def _recorder(self, label: str, total: int, *, warmup: bool = False) -> Recorder:
        self.progress.phase(f"{label} (warm-up)" if warmup else label)
        return Recorder(total=total, on_finish=None if warmup else self.progress.update)

    def offline(self, key: str, workload: Workload) -> RunStats:
        """Warm ``key`` up, then run ``workload`` with every request at t=0."""
        warm = self.warmup_for(workload)
        label = f"{workload.name} / {LABELS[key]}"
        run: Callable[[Workload, Recorder], RunStats]
        if key in STEP_SYSTEMS:
            system = self._step_system(
                key,
                longest_request(workload, warm),
                prefill_bound=self.settings.engine.max_prefill_tokens_with_decodes,
            )

            def run(w: Workload, r: Recorder) -> RunStats:
                return run_offline(system, w, r)

        elif key == SEQUENTIAL:

            def run(w: Workload, r: Recorder) -> RunStats:
                return peers.run_sequential(self.model, w, r)

        else:

            def run(w: Workload, r: Recorder) -> RunStats:
                batch = self.settings.engine.max_num_seqs
                return peers.run_static(self.model, w, r, batch_size=batch)

        run(warm, self._recorder(label, len(warm.requests), warmup=True))
        stats = run(workload, self._recorder(label, len(workload.requests)))
        if key in STEP_SYSTEMS:
            system.close()
        mx.clear_cache()
        return stats

    def backends(self, workload: Workload, *, rounds: int = 3) -> dict[str, Any]:
        """batchd on ``workload`` with each forward backend and sampler, same run
        (batchd.daemon.bench.engine_system.compare_backends)."""
        reason = self.batchd_unavailable()
        if reason is not None:
            raise SystemUnavailable(reason)
        from batchd.daemon.bench.engine_system import compare_backends

        self.progress.phase(f"backends: {workload.name}, {rounds} rounds")
        warm = self.warmup_for(workload).requests
        return compare_backends(
            self.settings.model_path, self.settings.engine, workload.requests, warm, rounds=rounds
        )

    def timed(
        self,
        key: str,
        workload: Workload,
        arrivals: list[float],
        *,
        prefill_bound: int | None,
    ) -> RunStats:
        """Warm ``key`` up, then run ``workload`` with requests arriving at ``arrivals``;
        batchd with ``max_prefill_tokens_with_decodes = prefill_bound``."""
        warm = self.warmup_for(workload)
        longest = longest_request(workload, warm)
        system = self._step_system(key, longest, prefill_bound=prefill_bound)
        label = f"{workload.name} / {LABELS[key]}"
        run_offline(system, warm, self._recorder(label, len(warm.requests), warmup=True))
        # batchd's engine reports its steps (the warm-up's are left out); BatchGenerator does not.
        steps: list[StepStats] | None = getattr(system, "steps", None)
        first = len(steps) if steps is not None else 0
        stats = run_timed(system, workload, arrivals, self._recorder(label, len(workload.requests)))
        if steps is not None:
            stats.engine_steps = step_profile(steps[first:])
        system.close()
        mx.clear_cache()
        return stats


def longest_request(*workloads: Workload) -> int:
    """Prompt + max_tokens of the longest request: what the KV pool must hold per sequence."""
    return max(len(r.prompt_ids) + r.max_tokens for w in workloads for r in w.requests)
