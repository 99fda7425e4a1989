"""Where batchd keeps its files: never the working directory; BATCHD_HOME, then systemd's
folders, then the platform's (the engine's cache and the producers' state alike)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

from batchd.config.paths import gateway_files, state_home
from batchd.engine.cache import cache_home, kernel_cache, model_cache
from batchd.engine.models.registry import ensure_preset, gguf_cache_dir


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BATCHD_HOME", "CACHE_DIRECTORY", "STATE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_the_platforms_folders() -> None:
    assert cache_home() == platformdirs.user_cache_path("batchd")
    assert state_home() == platformdirs.user_data_path("batchd")
    assert model_cache().is_absolute() and kernel_cache().is_absolute()


def test_batchd_home_takes_everything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/batchd")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/batchd")
    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))
    assert model_cache() == tmp_path / "models" and kernel_cache() == tmp_path / "kernels"
    assert gateway_files() == tmp_path / "gateway-files"


def test_a_relative_home_is_made_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHD_HOME", "state")
    assert cache_home() == state_home() == tmp_path / "state"


def test_systemd_folders_when_the_unit_declares_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/batchd:/var/cache/other")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/batchd")
    assert model_cache() == Path("/var/cache/batchd/models")
    assert gateway_files() == Path("/var/lib/batchd/gateway-files")


def test_presets_build_in_the_cache_whatever_the_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BATCHD_HOME", str(tmp_path / "home"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    built = ensure_preset("tiny")
    assert built == tmp_path / "home" / "models" / "tiny" and (built / "config.json").is_file()
    assert not any(elsewhere.iterdir())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert gguf_cache_dir(gguf).parent == tmp_path / "home" / "models" / "gguf"


def test_a_cli_subprocess_reads_the_same_home(tmp_path: Path) -> None:
    """The rule is read at call time from the environment, so a child started with
    BATCHD_HOME (a daemon, a chaos run's daemons) builds where its parent looks."""
    code = "from batchd.engine.cache import model_cache; print(model_cache())"
    env = {"BATCHD_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.stdout.strip() == str(tmp_path / "models"), out.stderr
