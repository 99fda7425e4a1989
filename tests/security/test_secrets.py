"""Credentials never leak, and batchd works with what a locked-down Redis allows.

End to end on real redis-servers: an ACL user limited to batchd's keys and the
commands batchd needs (no KEYS, FLUSHALL, CONFIG), a TLS-only listener with a
CA the test makes, and a password that must appear in no log line, error,
heartbeat, status or top output.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from batchd.producers.client import Client
from batchd.producers.errors import JobFailed
from batchd.producers.schema import JobState
from support.daemon_harness import (
    ROOT,
    FakeGenerator,
    expected_fake_tokens,
    fast_settings,
    worker_thread,
)
from support.redis_server import RedisServer, free_port

SECRET = "s3cret-Pa55"
# What a batchd daemon and its clients run; everything else (KEYS, FLUSHALL, CONFIG, DEBUG,
# SHUTDOWN, ...) is refused. INFO is asked for by name: the daemon reads the server's run_id.
BATCHD_ACL = [
    "on",
    f">{SECRET}",
    "~batchd:*",
    "&batchd:*",
    "-@all",
    "+@read",
    "+@write",
    "+@stream",
    "+@hash",
    "+@string",
    "+@pubsub",
    "+@scripting",
    "+@transaction",
    "+@connection",
    "+@keyspace",
    "-@dangerous",
    "+info",
    "+client|setname",
    "+client|id",
]


def _run_one_job(url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = fast_settings(url)
    prompt_ids = [5, 6, 7]
    with caplog.at_level(logging.DEBUG), worker_thread(settings, FakeGenerator):
        with Client(url) as client:
            handle = client.submit(prompt_token_ids=prompt_ids, max_tokens=6, seed=1)
            result = handle.result(timeout=30)
    assert result.token_ids == expected_fake_tokens(prompt_ids, 1, 6)
    assert SECRET not in caplog.text


def test_acl_user_limited_to_batchd_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "batchd", *BATCHD_ACL)
        url = f"redis://batchd:{SECRET}@127.0.0.1:{server.port}/0"
        limited = redis.Redis.from_url(url)
        for forbidden in (("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "GET", "dir")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                limited.execute_command(*forbidden)
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.set("other:key", "1")
        _run_one_job(url, tmp_path, caplog)
        heartbeats = [admin.get(k) or b"" for k in admin.scan_iter("batchd:daemon:*")]
        assert all(SECRET.encode() not in beat for beat in heartbeats)
        assert not [k for k in admin.scan_iter("*") if not k.startswith(b"batchd:")]
    finally:
        server.kill()


def _make_tls_files(directory: Path) -> dict[str, Path]:
    """A test CA and a server certificate for 127.0.0.1 signed by it (openssl CLI)."""
    files = {name: directory / name for name in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt")}
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=batchd-test-ca",
            "-keyout",
            files["ca.key"],
            "-out",
            files["ca.crt"],
        ],
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            files["s.key"],
            "-out",
            files["s.csr"],
        ],
        [
            "x509",
            "-req",
            "-in",
            files["s.csr"],
            "-CA",
            files["ca.crt"],
            "-CAkey",
            files["ca.key"],
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            ext,
            "-out",
            files["s.crt"],
        ],
    ]
    for step in steps:
        subprocess.run(["openssl", *map(str, step)], check=True, capture_output=True, timeout=60)
    return files


def test_tls_with_a_password(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed: cannot make a test CA")
    files = _make_tls_files(tmp_path)
    tls_port = free_port()
    server = RedisServer(
        tmp_path / "redis",
        extra_args=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(files["s.crt"]),
            "--tls-key-file",
            str(files["s.key"]),
            "--tls-ca-cert-file",
            str(files["ca.crt"]),
            "--tls-auth-clients",
            "no",
        ],
    )
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS: {exc}")
        raise
    try:
        server.client().execute_command("ACL", "SETUSER", "batchd", *BATCHD_ACL)
        url = f"rediss://batchd:{SECRET}@127.0.0.1:{tls_port}/0?ssl_ca_certs={files['ca.crt']}"
        assert redis.Redis.from_url(url).ping()
        _run_one_job(url, tmp_path, caplog)
    finally:
        server.kill()


@pytest.mark.parametrize(
    "args",
    [["status", "job1"], ["top", "--once"], ["submit", "hello"]],
    ids=["status", "top", "submit"],
)
def test_no_command_prints_the_password(args: list[str]) -> None:
    url = f"redis://batchd:{SECRET}@127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env["BATCHD_REDIS_URL"] = url
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert "batchd:***@" in proc.stderr or "Redis" in proc.stderr


def test_a_bad_url_setting_does_not_print_the_password() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env["BATCHD_REDIS_URL"] = f"http://batchd:{SECRET}@example:6379/0"
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.cli", "status", "job1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "redis_url" in proc.stderr and "***" in proc.stderr
    assert SECRET not in proc.stderr


def _producer_acl_from_docs() -> list[str]:
    """The security page's producer-only command list (the backticked run after
    "narrower still:", docs/security.md), so the documented user is the one tested."""
    text = " ".join((ROOT / "docs" / "security.md").read_text().split())
    _, _, after = text.partition("A producer-only service can be narrower still: `")
    commands, _, _ = after.partition("`")
    assert commands.startswith("+"), "docs/security.md: the producer-only command list is missing"
    return commands.split()


def test_the_documented_producer_user_submits_follows_and_cancels(tmp_path: Path) -> None:
    """A producer service given only the documented producer commands on batchd's keys
    cancels a queued job, submits (one job, several), follows jobs to their results
    and reads a status, while a daemon serves as the full batchd user. The scripts' own
    commands (EXISTS, HMGET...) are checked by Redis against that user too; the script
    cache is flushed first, so the client loads the scripts itself."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "batchd", *BATCHD_ACL)
        producer_acl = ["on", ">pw", "~batchd:*", "-@all", *_producer_acl_from_docs()]
        admin.execute_command("ACL", "SETUSER", "producer", *producer_acl)
        admin.script_flush()
        url = f"redis://batchd:{SECRET}@127.0.0.1:{server.port}/0"
        producer_url = f"redis://producer:pw@127.0.0.1:{server.port}/0"
        with Client(producer_url) as client:
            cancelled = client.submit(prompt_token_ids=[1, 2], max_tokens=4)
            assert cancelled.cancel()
            with worker_thread(fast_settings(url), FakeGenerator):
                handle = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=6, seed=1)
                assert handle.result(timeout=30).token_ids == expected_fake_tokens([5, 6, 7], 1, 6)
                jobs = [{"prompt_token_ids": [8, 9], "max_tokens": 4, "seed": 2}] * 3
                for job in client.submit_many(jobs):
                    assert job.result(timeout=30).token_ids == expected_fake_tokens([8, 9], 2, 4)
                with pytest.raises(JobFailed, match="cancelled"):
                    cancelled.result(timeout=30)
            assert client.status(handle.id).state is JobState.finished
        with redis.Redis.from_url(producer_url) as producer:
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.xreadgroup("g", "c", {"batchd:queue:default": ">"})
    finally:
        server.kill()
