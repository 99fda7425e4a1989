"""A producer's imports load nothing of the engine: no MLX, no BLAS, no environment changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: what the imports loaded, which shared libraries the process
# mapped, and which OPENBLAS_* variables it set.
PROBE = """
import json, os, sys
before = {{k for k in os.environ if k.startswith("OPENBLAS")}}
{imports}
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
print(json.dumps({{
    "modules": sorted(m for m in sys.modules
                      if m.split(".")[0] in {{"mlx", "mlx_lm", "numpy"}}
                      or m.startswith("batchd.engine") or m.startswith("batchd.daemon")),
    "blas": sorted({{line.split()[-1] for line in maps.splitlines() if "blas" in line.lower()}}),
    "env": sorted({{k for k in os.environ if k.startswith("OPENBLAS")}} - before),
}}))
"""


def _probe(imports: str) -> dict[str, list[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports)],
        cwd=ROOT,
        env=clean,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_producer_surface_loads_no_engine_blas_or_mlx() -> None:
    loaded = _probe(
        "import batchd\n"
        "from batchd import Client, AsyncClient\n"
        "import batchd.producers, batchd.producers.bulk, batchd.producers.bulk_worker\n"
        "import batchd.producers.gateway.app, batchd.producers.schema\n"
    )
    assert loaded == {"modules": [], "blas": [], "env": []}


def test_settings_and_producer_commands_load_no_blas_or_mlx() -> None:
    """The gateway's and the CLI's producer commands read the whole Settings (the engine's
    options among them): still no MLX, no BLAS and no OPENBLAS_* variable."""
    loaded = _probe(
        "import batchd.config.settings as s\n"
        "s.load_settings()\n"
        "import batchd.producers.commands.jobs, batchd.producers.commands.bulk\n"
        "import batchd.producers.commands.top, batchd.producers.commands.gateway\n"
        "from batchd.daemon.cli import build_parser\n"
        "build_parser().parse_args(['schema'])\n"
    )
    heavy = [m for m in loaded["modules"] if m.split(".")[0] in {"mlx", "mlx_lm", "numpy"}]
    assert heavy == [] and loaded["blas"] == [] and loaded["env"] == []


def test_the_probe_sees_a_blas_when_one_is_loaded() -> None:
    """The check above can fail: the engine's preload shows up in all three readings."""
    loaded = _probe("import batchd.engine.preload\nimport mlx.core\n")
    assert "mlx.core" in loaded["modules"]
    if sys.platform.startswith("linux"):
        assert loaded["blas"] and loaded["env"]
