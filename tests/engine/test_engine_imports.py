"""The scheduling half of the engine stays importable without MLX or Redis."""

from __future__ import annotations

import subprocess
import sys

PURE_MODULES = (
    "batchd.engine.config",
    "batchd.engine.sampling_params",
    "batchd.engine.scheduling.sequence",
    "batchd.engine.scheduling.block_manager",
    "batchd.engine.scheduling.schedule",
    "batchd.engine.scheduling.scheduler",
)

PROBE = """
import sys
for name in sys.argv[1:]:
    __import__(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "redis"))
print(",".join(heavy))
"""


def test_scheduling_modules_import_neither_mlx_nor_redis() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *PURE_MODULES],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == ""
