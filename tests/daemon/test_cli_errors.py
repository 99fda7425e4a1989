"""The mistakes a new user makes with ``batchd`` end in one message and a documented exit
code (2: the command line or settings; 3: Redis failed the command), never a traceback.

Each case runs the real command against a real redis-server (or a port nothing listens
on), in-process through ``main`` or as a ``batchd`` subprocess where it starts a server or
a daemon; docs/troubleshooting.md lists the messages.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchd.daemon.cli import main
from batchd.producers.keys import EVENT_FIELD, Keys, event_id
from batchd.producers.schema import Event
from support.redis_server import RedisServer, free_port


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``batchd ARGV`` in this process: exit code and stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def run_batchd(*argv: str, cwd: Path | None = None, timeout: float = 60.0) -> tuple[int, str]:
    """``batchd ARGV`` as a subprocess, offline (no hub download): exit code and stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("BATCHD_CONFIG", None)
    command = [sys.executable, "-m", "batchd.daemon.cli", *argv]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return out.returncode, out.stderr


def assert_one_error(err: str, *words: str) -> None:
    """``err`` names every one of ``words`` and holds no traceback."""
    assert "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something else already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("url_of", "words"),
    [
        (lambda s: f"redis://127.0.0.1:{free_port()}/0", ["cannot reach Redis", "start"]),
        (lambda s: f"redis://127.0.0.1:{s.port}/99", ["no database 99", "`databases`"]),
        (lambda s: f"redis://nobody:wrong@127.0.0.1:{s.port}/0", ["refused the login", "***"]),
        (lambda s: f"redis+cluster://127.0.0.1:{s.port}", ["cluster-enabled", "redis://"]),
        (
            lambda s: f"redis+sentinel://127.0.0.1:{free_port()}/mymaster",
            ["no Sentinel", "master"],
        ),
    ],
    ids=["refused", "db-out-of-range", "wrong-password", "cluster-on-standalone", "sentinel"],
)
def test_redis_failures_say_which_setting_to_fix(
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    url_of: Callable[[RedisServer], str],
    words: list[str],
) -> None:
    url = url_of(redis_server)
    for command in (["status", "j1"], ["top", "--once"]):
        code, err = run_main(capsys, "--redis-url", url, *command)
        assert code == 3
        assert_one_error(err, *words)
        assert "<redis." not in err  # no connection pool repr
        assert len(err.strip().splitlines()) == 1


def test_dashboard_without_redis_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err = run_main(capsys, "--redis-url", url, "dashboard", "--port", str(free_port()))
    assert code == 3
    assert_one_error(err, "batchd dashboard: cannot reach Redis", url)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://127.0.0.1:notaport/0", ["redis_url", "notaport", "HOST:PORT"]),
        ("http://127.0.0.1:6379", ["redis_url", "must start with redis://"]),
        ("redis://127.0.0.1:6379/0?db=x", ["redis_url", "'db'"]),
    ],
)
def test_malformed_redis_urls_are_settings_errors(
    capsys: pytest.CaptureFixture[str], url: str, words: list[str]
) -> None:
    code, err = run_main(capsys, "--redis-url", url, "status", "j1")
    assert code == 2
    assert_one_error(err, "invalid settings", *words)


def test_config_file_mistakes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("queues = [\n")
    code, err = run_main(capsys, "--config", str(broken), "status", "j1")
    assert code == 2
    assert_one_error(err, "broken.toml", "is not valid TOML")
    typo = tmp_path / "typo.toml"
    typo.write_text("[engine]\nmax_num_seq = 8\n")
    code, err = run_main(capsys, "--config", str(typo), "status", "j1")
    assert code == 2
    assert_one_error(err, "engine.max_num_seq", "unknown option", "configuration.md")
    code, err = run_main(capsys, "--config", str(tmp_path), "status", "j1")
    assert code == 2
    assert_one_error(err, str(tmp_path), "is not a file")


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("BATCHD_ENGINE__MAX_NUM_SEQS", "abc", ["engine.max_num_seqs", "valid integer"]),
        ("BATCHD_ENGINE__BLOCK_SIZE", "-16", ["engine.block_size (env BATCHD_ENGINE__BLOCK_SIZE)"]),
        ("BATCHD_QUEUES", "[", ["queues", "takes JSON in the environment"]),
    ],
)
def test_environment_mistakes_name_the_variable(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str,
    words: list[str],
) -> None:
    monkeypatch.setenv(name, value)
    code, err = run_main(capsys, "status", "j1")
    assert code == 2
    assert_one_error(err, "invalid settings", *words)


def test_submit_refuses_an_empty_prompt(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    for prompt in ("", "   "):
        code, err = run_main(capsys, "--redis-url", redis_server.url, "submit", prompt)
        assert code == 2
        assert_one_error(err, "prompt", "is empty")
    assert redis_server.client().keys("*") == []  # nothing was queued


@pytest.mark.parametrize("command", ["gateway", "dashboard"])
def test_http_commands_name_a_port_in_use(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], listening: int, command: str
) -> None:
    code, err = run_main(capsys, "--redis-url", redis_server.url, command, "--port", str(listening))
    assert code == 2
    assert_one_error(err, f"cannot listen on 127.0.0.1:{listening}", "--port")


def test_gateway_option_out_of_range_is_one_line(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_main(capsys, "--redis-url", redis_server.url, "gateway", "--port", "99999")
    assert code == 2
    assert_one_error(err, "--port (gateway.port) = 99999", "65535")
    assert "pydantic" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("/no/such/model", ["does not exist", "model folder"]),
        ("folder", ["is a folder but not a model", "config.json"]),
        ("short.gguf", ["truncated or corrupt"]),
        ("someorg/no-such-model", ["Hugging Face Hub id", "local cache"]),
    ],
)
def test_serve_names_what_is_wrong_with_the_model(
    tmp_path: Path, model: str, words: list[str]
) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("not a model")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # ends in the header
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err = run_batchd("--redis-url", url, "serve", "--model", model, cwd=tmp_path)
    assert code == 2
    assert_one_error(err, "batchd serve: cannot load model", *words)


def test_serve_names_a_database_redis_lacks(redis_server: RedisServer, tiny_model: Path) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/99"
    code, err = run_batchd("--redis-url", url, "serve", "--model", str(tiny_model))
    assert code == 3
    assert_one_error(err, "batchd serve: Redis at", "no database 99")


def test_serve_stops_at_a_login_redis_refuses(redis_server: RedisServer, tiny_model: Path) -> None:
    """A wrong user or password is no outage to ride out: serve says so and exits 3 (a
    supervisor's restart retries it, each time with the message)."""
    url = f"redis://nobody:wrong@127.0.0.1:{redis_server.port}/0"
    code, err = run_batchd("--redis-url", url, "serve", "--model", str(tiny_model))
    assert code == 3, err
    assert_one_error(err, "batchd serve: Redis at", "refused the login", "***")
    assert ":wrong@" not in err  # the password stays hidden


def test_make_model_mistakes(tmp_path: Path) -> None:
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF\x03\x00\x00\x00")
    code, err = run_batchd("make-model", "--model", str(short), str(tmp_path / "out"))
    assert code == 2
    assert_one_error(err, "truncated or corrupt")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("keep me")
    code, err = run_batchd("make-model", "--model", "tiny", str(busy))
    assert code == 2
    assert_one_error(err, "is not empty and holds no model", "new or empty folder")
    assert sorted(p.name for p in busy.iterdir()) == ["thesis.tex"]


def test_a_reader_that_stops_early_ends_the_stream_quietly(redis_server: RedisServer) -> None:
    """``batchd stream ID --json | head -1``: the pipe closes under the command, which
    ends with SIGPIPE's exit code and no traceback."""
    admin = redis_server.client()
    keys = Keys()
    admin.hset(keys.job("long"), mapping={"state": "running", "queue": "default"})
    for seq in range(3000):
        event = Event(seq=seq, token_id=1, text="token ").encode()
        admin.xadd(keys.events("long"), {EVENT_FIELD: event}, id=event_id(seq))
    admin.close()
    env = {**os.environ, "BATCHD_REDIS_URL": redis_server.url}
    command = [sys.executable, "-m", "batchd.daemon.cli", "stream", "long", "--json"]
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert reader.stdout is not None and reader.stderr is not None
    first = reader.stdout.readline()
    reader.stdout.close()  # what `head -1` does after its line
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=60) == 141, err
    assert b'"seq":0' in first and "Traceback" not in err and "Broken pipe" not in err, err


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_gateway_open_to_the_network_without_keys_says_so(
    redis_server: RedisServer, host: str, warned: bool
) -> None:
    """No key means no auth: fine on loopback, a warning on an address others reach."""
    env = {**os.environ, "BATCHD_REDIS_URL": redis_server.url}
    env.pop("BATCHD_GATEWAY_API_KEYS", None)
    port = str(free_port())
    command = [sys.executable, "-m", "batchd.daemon.cli", "gateway", "--host", host, "--port", port]
    gateway = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert gateway.stderr is not None
    try:
        seen = []
        for line in gateway.stderr:  # uvicorn's startup line comes after the check
            seen.append(line)
            if "Uvicorn running" in line or "Application startup complete" in line:
                break
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    said = "".join(seen)
    assert ("with no API key" in said) is warned, said
    assert "Traceback" not in said
