"""The GPU step probe (batchd.daemon.bench.gpu.step_probe) runs whole on a CPU: every
timing it prints is there, from a real engine and mlx-lm forward of a tiny shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_step_probe_prints_each_timing() -> None:
    args = ["--preset", "tiny", "--layers", "2", "--rows", "4", "--prompt", "32"]
    out = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.bench.gpu.step_probe", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        # MLX's own attention kernel, as on a GPU, for the bucketed-or-not agreement.
        env={**os.environ, "BATCHD_EXACT_MATH": "1"},
    ).stdout
    for name in ("products", "causal attention", "pool write"):
        assert re.search(rf"one layer at 32 rows: {name} +ms +\d+\.\d+", out), out
    differences = re.findall(r"bucketed vs not: max \|difference\| (\S+)", out)
    assert len(differences) == 2 and all(float(d) < 1e-4 for d in differences), out
    assert re.search(r"mlx-lm prompt of 32 +ms +\d+\.\d+", out), out
    assert re.search(r"mlx-lm 3 rows decoding +ms +\d+\.\d+", out), out
    # Five timed steps of each kind (a warm-up dropped), sixteen decode steps.
    assert re.search(r"prompt of 32 alone +steps +5 ", out), out
    assert re.search(r"3 rows decoding +steps +16 ", out), out
    assert re.search(r"3 decoding \+ prompt of 32 +steps +5 ", out), out
    for state in ("off", "on"):
        assert re.search(rf"3 decoding \+ new lengths, buckets {state} +steps +\d+ ", out), out
    assert "llm_engine.py" in out.split("ncalls", 1)[1], out
