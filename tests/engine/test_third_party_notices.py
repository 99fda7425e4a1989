"""transformers' no-PyTorch notice never reaches stderr; its real warnings still do."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from batchd.engine.preload import IMPORT_NOTICES, ImportNoticeFilter, demote_import_notices

import orjson

NOTICE = (
    "PyTorch was not found. Models won't be available and only tokenizers, configuration "
    "and file/data utilities can be used."
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # mlx-lm sets TRANSFORMERS_NO_ADVISORY_WARNINGS when imported; the engine imports
    # transformers before it (llguidance), so the notice comes unless batchd stops it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "BATCHD_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )


def test_an_engine_with_json_logs_writes_only_json(tiny_model: Path) -> None:
    # What `batchd --log-format json serve` does: logging first, then the engine.
    code = (
        "from batchd.producers.telemetry import configure_logging\n"
        "configure_logging('DEBUG', 'json')\n"
        "from batchd.engine.config import EngineConfig\n"
        "from batchd.engine.llm_engine import LLMEngine\n"
        f"LLMEngine.from_pretrained({str(tiny_model)!r}, EngineConfig(num_kv_blocks=64))\n"
    )
    stderr = _run(code).stderr
    lines = [orjson.loads(line) for line in stderr.splitlines()]  # raises on a non-JSON line
    assert any(line.get("event") == "kv_pool" for line in lines)
    if importlib.util.find_spec("torch") is None:
        # The notice is kept, at DEBUG, on batchd's logger.
        notices = [line for line in lines if "PyTorch was not found" in line["msg"]]
        assert [(n["level"], n["logger"]) for n in notices] == [
            ("DEBUG", "batchd.engine.thirdparty")
        ]


def test_importing_the_engine_prints_nothing() -> None:
    result = _run("import batchd.engine.llm_engine, mlx_lm.utils, transformers")
    assert result.stderr == ""


def test_other_transformers_warnings_pass() -> None:
    demote_import_notices()
    demote_import_notices()
    logger = logging.getLogger("transformers")
    assert sum(isinstance(f, ImportNoticeFilter) for f in logger.filters) == 1
    record = logger.makeRecord("transformers", logging.WARNING, __file__, 1, "x", None, None)
    for text, passes in [(NOTICE, False), (IMPORT_NOTICES[1] + " ...", False), ("real", True)]:
        record.msg = text
        assert ImportNoticeFilter().filter(record) is passes
