"""Every way redis-py accepts a password is redacted in every message (security finding 5).

The table is checked against redis-py itself: each URL's password, as
``redis.connection.parse_url`` reads it, must be gone from the redacted text. Before the
fix ``redis://:pa@ss@host`` printed as ``:***@ss@host`` and ``?password=`` was printed
whole, also in the CLI's "cannot reach Redis" message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.connection import parse_url

from batchd.config.secrets import redact
from batchd.daemon.cli import main
from support.redis_server import free_port

# (URL, what redact must give)
TABLE = [
    ("redis://user:pa55@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:pa@ss@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://user:pa:ss@host/0", "redis://user:***@host/0"),
    ("redis://u:p%40ss%3Aw@host/0", "redis://u:***@host/0"),
    ("rediss://user:secret@host:6380/0", "rediss://user:***@host:6380/0"),
    ("redis://host:6379/0?password=secret", "redis://host:6379/0?password=***"),
    ("redis://host/0?db=1&password=secret&x=1", "redis://host/0?db=1&password=***&x=1"),
    ("redis://host/0?PASSWORD=secret", "redis://host/0?PASSWORD=***"),
    ("redis://host/0?pass%77ord=secret", "redis://host/0?pass%77ord=***"),
    (
        "rediss://host/0?ssl_ca_certs=/ca.crt&ssl_password=keypass",
        "rediss://host/0?ssl_ca_certs=/ca.crt&ssl_password=***",
    ),
    ("unix://:sock-pass@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("unix:///run/redis.sock?password=secret", "unix:///run/redis.sock?password=***"),
    ("redis://:a@b@c@host:1/0?password=d", "redis://:***@host:1/0?password=***"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),  # a user name is no secret
    ("redis://host:6379/0", "redis://host:6379/0"),
]


@pytest.mark.parametrize(("url", "shown"), TABLE, ids=[u for u, _ in TABLE])
def test_every_password_redis_py_reads_is_redacted(url: str, shown: str) -> None:
    assert redact(url) == shown
    for name in ("password", "ssl_password"):
        secret = parse_url(url).get(name)
        if secret:
            assert secret not in redact(f"error at {url} (retrying)")


def test_urls_inside_messages_and_reprs() -> None:
    text = "cannot reach 'redis://:pa@ss@h:1/0', nor rediss://u:x@h2/0?password=y; done"
    assert redact(text) == (
        "cannot reach 'redis://:***@h:1/0', nor rediss://u:***@h2/0?password=***; done"
    )


@pytest.mark.parametrize("command", [["status", "job-1"], ["bulk", "in.jsonl", "--out", "o"]])
@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:{port}/0?password=hunter2", "redis://:hun@ter2@127.0.0.1:{port}/0"],
)
def test_cannot_reach_redis_never_prints_the_password(
    command: list[str], url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--redis-url", url.format(port=free_port()), *command]
    if command[0] == "bulk":
        source = tmp_path / "in.jsonl"
        source.write_text('{"prompt": "x"}\n')
        argv = [*argv[:3], str(source), "--out", str(tmp_path / "o")]
        argv += ["--files-dir", str(tmp_path / "files")]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "cannot reach Redis" in err
    assert "hunter2" not in err and "ter2@" not in err
