"""A stranger's install: the wheel built from this tree, installed into fresh virtualenvs
outside the repository, run from a temporary directory.

- the wheel holds one top-level package, ``batchd``, with the C kernels' sources;
- ``[daemon,gateway]``: ``batchd --version``, ``batchd doctor`` (kernels built from the
  wheel's sources in a fresh cache), ``batchd serve`` on the tiny preset answering a job
  that ``batchd submit --stream`` prints, and a small ``batchd chaos`` run with one kill;
- the base install: importing the producers loads no MLX, NumPy or engine module, and the
  daemon's commands say which extra to install;
- beside python-daemon (which owns the top-level name ``daemon``) both import, and
  uninstalling it leaves batchd whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

from support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("engine", "daemon", "producers", "config")
# What is left out of the copy the wheel is built from: build outputs, caches, venvs
# anywhere, and the repository's own docs/ and tests/ (not package folders of that name).
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".batchd",
    "bench-out",
)  # fmt: skip
TOP_LEVEL_ONLY = {"docs", "tests", "site"}

# Each step below has its own timeout (the wheel's build and each venv's install 600 s,
# serve's start 120 s, the chaos run 400 s); the first test to need a venv also builds it.
# pytest's default 300 s would end a loaded host's legitimate run first, without the
# step's output: this outer bound only catches what no step's timeout does.
pytestmark = pytest.mark.timeout(1200)


def not_source(folder: str, names: list[str]) -> set[str]:
    ignored = set(NOT_SOURCE(folder, names))
    if Path(folder) == ROOT:
        ignored |= TOP_LEVEL_ONLY & set(names)
    return ignored


def run(
    args: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout's venv or settings on it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BATCHD_", "PYTHON", "VIRTUAL_ENV", "OPENBLAS"))
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built (as pip builds it, isolated) from a copy of this tree."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=not_source, symlinks=True)
    out = work / "dist"
    python = sys.executable
    run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, source], cwd=work)
    (built,) = out.glob("batchd-*.whl")
    return built


def new_venv(where: Path, requirement: str) -> Path:
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
        cwd=where,
    )
    return python


@pytest.fixture(scope="module")
def daemon_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_venv(tmp_path_factory.mktemp("venv-daemon") / "venv", f"{wheel}[daemon,gateway]")


@pytest.fixture(scope="module")
def base_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_venv(tmp_path_factory.mktemp("venv-base") / "venv", str(wheel))


def test_every_package_folder_is_in_the_distribution() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {"batchd"} | {
        "batchd." + ".".join(init.parent.relative_to(ROOT).parts)
        for room in ROOMS
        for init in (ROOT / room).rglob("__init__.py")
    }
    assert listed == found


def test_the_wheel_holds_only_batchd_with_its_kernel_sources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"batchd"}, tops
    kernels = {Path(n).name for n in names if n.startswith("batchd/engine/forward/")}
    sources = {p.name for p in (ROOT / "engine" / "forward").glob("*.[ch]")}
    assert sources and sources <= kernels
    for data in ("batchd/config/batchd.toml", "batchd/producers/protocol.schema.json"):
        assert data in names
    assert "batchd/py.typed" in names


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def test_installed_daemon_serves_streams_and_survives_a_kill(
    daemon_venv: Path, redis_url: str, tmp_path: Path
) -> None:
    bin_dir = daemon_venv.parent
    batchd = bin_dir / "batchd"
    # A fresh home: the kernels must be built from the wheel's own sources.
    env = clean_env(BATCHD_HOME=str(tmp_path / "home"))
    where = tmp_path / "anywhere"
    where.mkdir()

    version = run([batchd, "--version"], cwd=where, env=env).stdout.strip()
    assert re.fullmatch(r"batchd \S+", version), version

    doctor = run([batchd, "doctor", "--json", "--redis-url", redis_url], cwd=where, env=env)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["C kernels"]["detail"].startswith("built (" + str(tmp_path / "home")), checks

    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(
            [batchd, "serve", "--preset", "tiny", "--redis-url", redis_url],
            cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while b"serving queues" not in log_path.read_bytes():
            assert serve.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        submitted = run(
            [batchd, "submit", "Say hello.", "--stream", "--max-tokens", "12", "--seed", "1",
             "--redis-url", redis_url],
            cwd=where, env=env, timeout=120,
        )  # fmt: skip
        assert submitted.stdout.strip(), submitted.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    assert serve.returncode == 0, log_path.read_text()
    assert (tmp_path / "home" / "models" / "tiny" / "config.json").is_file()
    assert not any(where.iterdir()), list(where.iterdir())  # nothing in the working directory

    chaos = run(
        [batchd, "chaos", "--jobs", "24", "--kills", "1", "--daemons", "2", "--hostile", "4",
         "--redis-crashes", "0", "--each-other-fault", "0", "--result-ttl", "5",
         "--minutes", "5"],
        cwd=where, env=env, timeout=400,
    )  # fmt: skip
    assert "daemon SIGKILL" in chaos.stdout, chaos.stdout


def test_base_install_imports_producers_without_the_engine(base_venv: Path, tmp_path: Path) -> None:
    probe = (
        "import json, sys\n"
        "import batchd.producers, batchd.producers.client, batchd.producers.bulk\n"
        "from batchd import Client, AsyncClient\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'mlx', 'mlx_lm', 'numpy'} or m.startswith('batchd.engine'))))\n"
    )
    loaded = run([base_venv, "-c", probe], cwd=tmp_path, env=clean_env()).stdout
    assert json.loads(loaded) == []
    schema = run([base_venv.parent / "batchd", "schema"], cwd=tmp_path, env=clean_env())
    assert json.loads(schema.stdout)["title"]
    refused = subprocess.run(
        [base_venv.parent / "batchd", "serve", "--preset", "tiny"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert 'pip install "$(ls dist/batchd-*.whl)[daemon]"' in refused.stderr


def test_beside_python_daemon_both_import(base_venv: Path, tmp_path: Path) -> None:
    env = clean_env()
    pip = [base_venv, "-m", "pip", "-q", "--disable-pip-version-check"]
    run([*pip, "install", "python-daemon"], cwd=tmp_path, env=env)
    both = "from daemon import DaemonContext\nimport batchd.daemon, batchd.producers.client\n"
    run([base_venv, "-c", both], cwd=tmp_path, env=env)
    run([*pip, "uninstall", "-y", "python-daemon"], cwd=tmp_path, env=env)
    run([base_venv, "-c", "import batchd.daemon, batchd.producers.client"], cwd=tmp_path, env=env)
    run([base_venv.parent / "batchd", "--version"], cwd=tmp_path, env=env)
