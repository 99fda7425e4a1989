"""``batchd doctor``: what this machine will run, checked where it matters.

One line per part a daemon depends on: MLX and its device, the BLAS behind MLX's CPU
products, batchd's C kernels (built, or why not and what that costs), the model cache and
state folders, the optional extras, and whether Redis answers at the configured URL.
Works on a producer-only install too: a missing part is reported with the command that
installs it, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from batchd.config.secrets import redact
from batchd.config.settings import Settings
from batchd.producers.commands.extras import install_command
from batchd.producers.commands.subcommand import add_command

DAEMON_EXTRA = install_command(["daemon"])
GATEWAY_EXTRA = install_command(["gateway"])


@dataclass(frozen=True)
class Check:
    """One part of the machine: ``ok`` False means a daemon cannot serve as configured."""

    name: str
    ok: bool
    detail: str


def register(sub: Any) -> None:
    p = add_command(sub, "doctor", doctor)
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def doctor(args: argparse.Namespace, settings: Settings) -> int:
    """Print what this machine will run: MLX device, BLAS, kernels, folders, Redis.

    Each line names a part and what batchd found: the MLX version and device, the BLAS
    MLX's CPU products use, whether batchd's C kernels are built (or why not, and what
    that costs), the model cache and state folders, the gateway extra, and whether Redis
    answers at the configured URL. Exits 1 when something a daemon needs is missing
    (MLX, a writable cache, Redis), else 0.
    """
    checks = [*_machine_checks(), *_folder_checks(), _gateway_check(), _redis_check(settings)]
    if args.json:
        print(orjson.dumps([asdict(c) for c in checks], option=orjson.OPT_INDENT_2).decode())
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            mark = "ok  " if check.ok else "FAIL"
            print(f"{mark} {check.name:<{width}}  {check.detail}")
    return 0 if all(c.ok for c in checks) else 1


def _machine_checks() -> list[Check]:
    from batchd import __version__

    head = Check(
        "batchd",
        True,
        f"{__version__} (Python {platform.python_version()}, {platform.system()} "
        f"{platform.machine()})",
    )
    if importlib.util.find_spec("mlx") is None:
        missing = f"not installed: the daemon needs it ({DAEMON_EXTRA})"
        return [head, Check("MLX", False, missing)]
    import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

    import mlx.core as mx

    from batchd.engine import blas
    from batchd.engine.forward import native

    device = mx.default_device()
    on_gpu = device.type == mx.DeviceType.gpu
    mlx_line = f"{importlib.metadata.version('mlx')}, device {device.type.name}"
    checks = [head, Check("MLX", True, mlx_line)]
    if sys.platform == "darwin":
        checks.append(Check("BLAS", True, "Accelerate (MLX's own on macOS)"))
    elif blas.loaded_openblas() is not None:
        core = blas.loaded_core() or "unknown"
        checks.append(Check("BLAS", True, f"OpenBLAS {blas.loaded_openblas()} ({core} kernels)"))
    else:
        checks.append(Check("BLAS", True, f"MLX's reference BLAS: {blas.INSTALL_HINT}"))
    if on_gpu:
        checks.append(Check("C kernels", True, "not used: MLX runs on the GPU"))
    else:
        checks.append(Check("C kernels", True, native.describe()))
    checks.append(Check("forward backend", True, _backend_line()))
    return checks


def _backend_line() -> str:
    """The backend a float32 model would run on here with the default options, and why
    (a model in another dtype, or a quantized KV pool, runs on mlx: the start log says)."""
    from batchd.engine.forward.backend import AUTO, choose

    return choose(AUTO, dtype=None).describe() + " (float32 models; others: mlx)"


def _folder_checks() -> list[Check]:
    from batchd.config.paths import state_home
    from batchd.engine.cache import model_cache

    models = model_cache()
    built = sorted(p.name for p in models.iterdir() if p.is_dir()) if models.is_dir() else []
    writable = _writable(models)
    detail = f"{models} ({'writable' if writable else 'NOT writable'}"
    detail += f"; holds {', '.join(built)})" if built else "; empty)"
    return [Check("model cache", writable, detail), Check("state", True, str(state_home()))]


def _writable(folder: Path) -> bool:
    """Whether ``folder`` exists and can be written, or could be created."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def _gateway_check() -> Check:
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return Check("gateway", True, f"not installed ({GATEWAY_EXTRA} for `batchd gateway`)")
    versions = ", ".join(f"{m} {importlib.metadata.version(m)}" for m in ("starlette", "uvicorn"))
    return Check("gateway", True, versions)


def _redis_check(settings: Settings) -> Check:
    import redis

    from batchd.producers.connection import redis_client

    url = redact(settings.connection_url())
    client = redis_client(settings.connection_url(), socket_connect_timeout=3, socket_timeout=3)
    try:
        info = client.info("server")
    except redis.RedisError as exc:
        return Check(
            "Redis", False, f"{url}: no answer ({exc}); set --redis-url or BATCHD_REDIS_URL"
        )
    finally:
        client.close()
    return Check("Redis", True, f"{url}: Redis {info.get('redis_version', '?')} answers")
