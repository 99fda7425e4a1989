"""``batchd serve`` on an architecture of the generic path (CI-sized): a daemon subprocess
serving a tiny random-weight gemma3_text (5:1-style local/global sliding windows, built from
mlx-lm's classes) answers jobs through Redis greedy-equal to mlx-lm, prompts longer than
the window included. The real Gemma 3 270M through a daemon is the slow
tests/engine/models/test_gemma3_270m_serve.py."""

from __future__ import annotations

import random
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, served_greedy

from batchd.engine.models.arch_fixture import VOCAB, WINDOW, make_arch_model
from batchd.engine.models.loader import load
from support.daemon_harness import DaemonProcess, daemon_config
from support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(600)


def test_serve_a_generic_architecture_greedy_equal_to_mlx_lm(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    model_dir = make_arch_model(tmp_path / "gemma3", "gemma3_text")
    rng = random.Random(11)
    reqs = [
        Req(tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(5, 3 * WINDOW))), 12)
        for _ in range(4)
    ]
    assert any(len(r.prompt) > WINDOW for r in reqs)
    daemon = DaemonProcess(
        daemon_config(tmp_path, redis_server.url), model=model_dir, log_path=tmp_path / "d.log"
    )
    results = served_greedy(daemon, redis_server.url, reqs)
    assert "generic path" in daemon.log_tail(200_000)
    report = check_parity(Reference(load(model_dir).model), reqs, [r.token_ids for r in results])
    assert not report.divergences, report.divergences
