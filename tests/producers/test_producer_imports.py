"""Producers never import MLX, and a base install (no daemon extra) can produce."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_producer_modules_do_not_import_mlx() -> None:
    code = (
        "import sys\n"
        "import producers, producers.client, producers.aio, producers.bulk, config\n"
        "import producers.commands.jobs, producers.commands.bulk, producers.commands.top\n"
        "from daemon.cli import build_parser\n"
        "build_parser().parse_args(['schema'])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {'mlx', 'mlx_lm'})\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


@pytest.mark.slow
def test_base_install_without_daemon_extra(tmp_path: Path) -> None:
    """``pip install .`` (no extras) is enough to import the producers and print the schema."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT)], check=True, timeout=600)
    probe = (
        "import producers.client, producers.bulk, config; import importlib.util as u; "
        "assert u.find_spec('mlx') is None"
    )
    subprocess.run([python, "-c", probe], check=True, cwd=tmp_path, timeout=60)
    printed = subprocess.run(
        [env_dir / "bin" / "batchd", "schema"], check=True, capture_output=True, timeout=60
    ).stdout
    assert printed == (ROOT / "producers" / "protocol.schema.json").read_bytes()
