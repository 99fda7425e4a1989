"""``batchd demo`` end to end on a private Redis (steps unpaced to keep it quick)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.daemon_harness import ROOT
from support.redis_server import RedisServer


def test_demo_streams_every_job_and_shows_steps(
    redis_server: RedisServer, tiny_model: Path
) -> None:
    args = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url", redis_server.url]
    args += ["--log-level", "WARNING", "demo", "--show-steps", "--step-ms", "0"]
    args += ["--preset", "tiny", "--model-dir", str(tiny_model)]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "Redis: configured" in out
    assert "8 jobs, 448 tokens" in out
    assert "batch sizes seen" in out
    assert "| decode: job" in out and "prefill: job" in out
    assert out.count("[length]") >= 8
    # The demo's keys live under its own prefix: nothing under the default one.
    assert redis_server.client().keys("batchd:*") == []


@pytest.mark.slow
def test_demo_on_smollm2_answers_questions(redis_server: RedisServer, tmp_path: Path) -> None:
    """The default demo: the real model's answers stream in and the transcript shows them."""
    args = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url", redis_server.url]
    args += ["--log-level", "WARNING", "demo", "--model-dir", str(tmp_path / "smollm2")]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "serving smollm2, answering chat questions: 8 jobs" in out
    assert "[capital] Q: What is the capital of France?\n    The capital of France is Paris." in out
    assert "Pacific" in out
    assert out.count("[stop]") >= 4
