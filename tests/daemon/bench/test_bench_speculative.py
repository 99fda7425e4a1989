"""The speculative workload (batchd.daemon.bench.speculative) on the tiny model: both
request sets run off and on, outputs compared, figures and the report's section."""

from __future__ import annotations

import io
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.speculative import (
    run_speculative,
    speculative_headline,
    speculative_lines,
)
from batchd.daemon.bench.workloads import SCALES
from batchd.engine import EngineConfig


def test_speculative_workload_runs_both_sets_off_and_on(tiny_model: Path) -> None:
    result = run_speculative(
        model_path=tiny_model,
        engine=EngineConfig(max_num_seqs=4, speculative_ngram_min=1),
        scale=SCALES["tiny"],
        vocab_size=1024,
        seed=0,
        progress=Progress(stream=io.StringIO()),
        rounds=1,
    )
    for name in ("extraction", "mixed"):
        r = result[name]
        assert r["identical"], name
        assert set(r["systems"]) == {"off", "ngram"}
        assert r["systems"]["off"]["draft_tokens"] == 0
        assert r["output_tokens"] > 0 and r["speedup"] > 0
    assert "speculative extraction" in speculative_headline(result)
    assert any(line.startswith("| extraction") for line in speculative_lines(result))
