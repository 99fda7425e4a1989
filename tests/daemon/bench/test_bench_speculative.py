"""The speculative workload (batchd.daemon.bench.speculative) on the tiny model: both
request sets run off and on, outputs compared, figures and the report's section."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.config.settings import Settings
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.speculative import (
    run_speculative,
    speculative_headline,
    speculative_lines,
)
from batchd.daemon.bench.workloads import SCALES
from batchd.daemon.commands.bench import register, run, speculative_problem
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
    assert result["method"] == "ngram"
    assert "speculative extraction" in speculative_headline(result)
    assert "with ngram" in speculative_headline(result)
    lines = speculative_lines(result)
    assert "n-gram prompt lookup" in lines[0]
    assert any(line.startswith("| extraction") for line in lines)


def test_speculative_workload_with_a_draft_model(tiny_model: Path) -> None:
    # The tiny model as its own draft: a handful of requests of each set.
    result = run_speculative(
        model_path=tiny_model,
        engine=EngineConfig(max_num_seqs=4),
        scale=SCALES["tiny"],
        vocab_size=1024,
        seed=0,
        progress=Progress(stream=io.StringIO()),
        rounds=1,
        method="draft",
        draft_model=str(tiny_model),
        limit=3,
    )
    assert result["method"] == "draft" and result["draft_model"] == str(tiny_model)
    for name in ("extraction", "mixed"):
        r = result[name]
        assert r["requests"] == 3 and r["output_tokens"] > 0
        assert r["identical"], name
        assert set(r["systems"]) == {"off", "draft"}
        draft = r["systems"]["draft"]
        assert draft["draft_tokens"] > 0
        # The model as its own draft: it agrees with itself on (nearly) every token.
        assert 0.5 < draft["acceptance_rate"] <= 1.0
        assert r["speedup"] > 0
    assert "with draft" in speculative_headline(result)
    lines = speculative_lines(result)
    assert lines[0] == "## Speculative decoding (draft model)"
    assert any("| draft tok/s |" in line for line in lines)
    assert any(line.startswith("| mixed (3)") for line in lines)


def test_bench_cli_refuses_draft_without_a_draft_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for argv, needle in (
        (["bench", "--workload", "speculative", "--speculative-method", "draft"], "needs"),
        (["bench", "--workload", "speculative", "--draft-model", "tiny"], "only with"),
    ):
        args = parser.parse_args(argv)
        assert speculative_problem(args) is not None
        assert run(args, Settings()) == 2
        assert needle in capsys.readouterr().err
    args = parser.parse_args(["bench", "--speculative-method", "draft", "--draft-model", "tiny"])
    assert speculative_problem(args) is None
