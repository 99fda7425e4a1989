"""``batchd dashboard`` as a user runs it: it serves, and refuses keys that would be unsafe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from batchd.config.settings import Settings
from batchd.daemon.cli import build_parser
from support.redis_server import RedisServer, free_port


def run(*argv: str) -> int:
    """The command's handler on parsed arguments (main() would set up logging)."""
    args = build_parser().parse_args(["dashboard", *argv])
    code: int = args.func(args, Settings())
    return code


def test_short_operator_keys_and_gateway_keys_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run("--operator-key", "short") == 2
    assert "16 characters" in capsys.readouterr().err
    shared = "a-key-the-gateway-also-takes"
    monkeypatch.setenv("BATCHD_GATEWAY_API_KEYS", f"other-one,{shared}")
    assert run("--operator-key", shared) == 2
    assert "must not be a gateway API key" in capsys.readouterr().err
    missing = tmp_path / "nope"
    assert run("--operator-key-file", str(missing)) == 2


def test_the_command_serves_the_dashboard(redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    keys = tmp_path / "operator.keys"
    keys.write_text("command-operator-key-0123456789\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    args = [sys.executable, "-m", "batchd.daemon.cli", "dashboard", "--port", str(port)]
    args += ["--redis-url", redis_server.url, "--operator-key-file", str(keys)]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "did not serve"
                time.sleep(0.1)
        assert page.status_code == 200 and "operator login" in page.text
        assert httpx.get(f"http://127.0.0.1:{port}/static/dashboard.js").status_code == 200
        refused = httpx.post(f"http://127.0.0.1:{port}/jobs/x/cancel")
        assert refused.status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    # uvicorn stops gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM), err.decode()
    assert b"Application shutdown complete" in err
    assert redis_server.url not in err.decode()
