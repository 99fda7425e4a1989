"""The [gateway] and [bulk] settings: one definition, TOML and environment, flags on top;
and the gateway process logs every line, uvicorn's included, in the chosen format."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import httpx
import orjson
import pytest

from batchd.config.sections import BulkSettings, GatewaySettings
from batchd.config.settings import load_settings
from batchd.daemon.cli import build_parser
from batchd.producers.bulk_liveness import Liveness
from batchd.producers.commands.gateway import gateway_settings
from batchd.producers.gateway.options import GatewayOptions
from support.redis_server import RedisServer, free_port


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [n for n in os.environ if n.startswith("BATCHD_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_gateway_options_default_to_the_settings_defaults() -> None:
    section = GatewaySettings()
    options = GatewayOptions()
    for field in fields(GatewayOptions):
        if hasattr(section, field.name):
            assert getattr(options, field.name) == getattr(section, field.name), field.name


def test_toml_then_environment_then_flags(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    config = tmp_path / "batchd.toml"
    config.write_text(
        "[gateway]\nport = 9001\nmax_backlog = 10\ndefault_max_tokens = 300\n"
        '[bulk]\nrq_queue = "other"\nheartbeat_ttl_s = 3.0\n'
    )
    clean_env.setenv("BATCHD_GATEWAY__MAX_BACKLOG", "20")
    settings = load_settings(config)
    assert (settings.gateway.port, settings.gateway.max_backlog) == (9001, 20)
    args = build_parser().parse_args(["gateway", "--max-backlog", "30", "--header-timeout-s", "2"])
    section = gateway_settings(args, settings)
    assert (section.port, section.max_backlog, section.header_timeout_s) == (9001, 30, 2.0)
    options = GatewayOptions.from_settings(section, rq_queue=settings.bulk.rq_queue)
    assert (options.max_backlog, options.default_max_tokens, options.rq_queue) == (30, 300, "other")
    liveness = Liveness.from_settings(settings.bulk, prefix="p")
    assert liveness.ttl_s == 3.0 and liveness.worker_key("w") == "p:bulk:worker:w"
    bad = build_parser().parse_args(["gateway", "--max-connections", "0"])
    with pytest.raises(ValueError):
        gateway_settings(bad, settings)
    assert BulkSettings().fork is True


def test_every_gateway_log_line_is_json(tmp_path: Path) -> None:
    """`batchd gateway --log-format json`: uvicorn's start lines and its access lines too."""
    server = RedisServer(tmp_path / "redis").start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    command = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url", server.url]
    command += ["--log-format", "json", "gateway", "--port", str(port)]
    command += ["--files-dir", str(tmp_path / "files")]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health/live").status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/nowhere").status_code == 404
    finally:
        proc.terminate()
        proc.wait(30)
        server.kill()
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines() if line.strip()]
    loggers = {line["logger"] for line in lines}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers, loggers
    access = [line for line in lines if line.get("event") == "http_request"]
    assert {(a["method"], a["path"], a["status"]) for a in access} >= {
        ("GET", "/health/live", 200),
        ("GET", "/nowhere", 404),
    }
