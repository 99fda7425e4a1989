"""``batchd doctor``: each part it reports is what the process really found, and a missing
part fails its line (and the exit code) with the fix, never with a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.redis_server import RedisServer

# Runs the CLI with some top-level modules made unimportable, as on an install without them.
# Runs the CLI with some top-level modules made unimportable, as on an install without
# them: a None entry in sys.modules makes imports fail and find_spec answer None.
WITHOUT = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None
from batchd.daemon.cli import main
sys.exit(main(sys.argv[2:]))
"""


def doctor(
    tmp_path: Path, *args: str, blocked: str = "", env: dict[str, str] | None = None
) -> tuple[int, dict[str, dict[str, object]], str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT, blocked, "doctor", "--json", *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    checks = {c["name"]: c for c in json.loads(done.stdout)} if done.stdout.strip() else {}
    return done.returncode, checks, done.stderr


def test_a_ready_machine_passes_every_check(tmp_path: Path, redis_server: RedisServer) -> None:
    code, checks, stderr = doctor(tmp_path, "--redis-url", redis_server.url)
    assert code == 0, (checks, stderr)
    assert all(c["ok"] for c in checks.values())
    assert "device cpu" in str(checks["MLX"]["detail"]) or "gpu" in str(checks["MLX"]["detail"])
    assert str(checks["C kernels"]["detail"]).startswith(("built (", "not used"))
    # The forward backend a float32 model would get here, where it samples, and why.
    assert str(checks["forward backend"]["detail"]).startswith(("native_cpu (", "mlx ("))
    assert "answers" in str(checks["Redis"]["detail"])


def test_unreachable_redis_fails_its_line(tmp_path: Path, redis_server: RedisServer) -> None:
    port = redis_server.port
    redis_server.kill()
    code, checks, _ = doctor(tmp_path, "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert code == 1 and not checks["Redis"]["ok"] and checks["MLX"]["ok"]


def test_an_unwritable_model_cache_fails_its_line(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = {"BATCHD_HOME": str(blocker / "home")}  # under a file: can never be created
    code, checks, _ = doctor(tmp_path, "--redis-url", redis_server.url, env=home)
    assert code == 1 and not checks["model cache"]["ok"]
    assert str(blocker / "home" / "models") in str(checks["model cache"]["detail"])


def test_a_producer_only_install_is_told_what_to_install(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    code, checks, stderr = doctor(
        tmp_path, "--redis-url", redis_server.url, blocked="mlx,starlette,uvicorn"
    )
    assert code == 1 and "Traceback" not in stderr
    assert not checks["MLX"]["ok"] and "whl)[daemon]" in str(checks["MLX"]["detail"])
    assert "whl)[gateway]" in str(checks["gateway"]["detail"])
    assert checks["Redis"]["ok"]
