"""The ops parts alone: sd_notify datagrams, ping pacing, JSON lines, masked secrets."""

from __future__ import annotations

import io
import logging
import os
import socket
from pathlib import Path

import orjson
import pytest

from batchd.config.secrets import redact
from batchd.daemon.ops.notify import Notifier, watchdog_period_s
from batchd.daemon.ops.supervisor import Supervisor
from batchd.producers.telemetry import TEXT_FORMAT, JsonFormatter, RedactingFormatter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def receiver(tmp_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(f"\0batchd-test-{os.getpid()}-{id(tmp_path)}")  # abstract: no path length limit
    sock.settimeout(2)
    return sock


def test_notifier_speaks_to_an_abstract_socket(receiver: socket.socket) -> None:
    name = receiver.getsockname()
    address = "@" + (name[1:].decode() if isinstance(name, bytes) else name[1:])
    Notifier(address).send("READY=1", "STATUS=ok")
    assert receiver.recv(100) == b"READY=1\nSTATUS=ok"


def test_no_socket_no_messages_and_a_gone_supervisor_never_raises(tmp_path: Path) -> None:
    Notifier(None).send("READY=1")
    Notifier(str(tmp_path / "missing.sock")).send("WATCHDOG=1")


def test_watchdog_period_is_for_this_process_only() -> None:
    assert watchdog_period_s({"WATCHDOG_USEC": "4000000"}) == 4.0
    assert watchdog_period_s({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_period_s({}) is None


def test_supervisor_pings_at_half_the_period_and_status_once_a_second() -> None:
    sent: list[tuple[str, ...]] = []
    notifier = Notifier("unused")
    notifier.send = lambda *lines: sent.append(lines)  # type: ignore[method-assign]
    clock = Clock()
    supervisor = Supervisor(notifier, watchdog_s=1.0, clock=clock)
    supervisor.ready("serving")
    for _ in range(9):  # 1 s of loop turns, one every 0.125 s
        supervisor.alive(lambda: "busy")
        clock.now += 0.125
    pings = [lines for lines in sent if "WATCHDOG=1" in lines]
    statuses = [lines for lines in sent if "STATUS=busy" in lines]
    assert sent[0] == ("READY=1", "STATUS=serving")
    assert len(pings) == 3 and len(statuses) == 1


def logger_to(stream: io.StringIO, formatter: logging.Formatter) -> logging.Logger:
    """A logger of its own (the root logger, pytest's, stays as it is)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log = logging.getLogger(f"test.ops.{id(stream)}")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


def test_json_lines_carry_fields_and_the_job_id() -> None:
    stream = io.StringIO()
    log = logger_to(stream, JsonFormatter())
    log.info("job %s rejected: %s", "j1", "bad")
    log.info("finished", extra={"event": "job_finished", "job_id": "j2", "usage": {"n": 1}})
    log.debug("hidden")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("connecting to redis://u:pw@h:1/0 failed")
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["job_id"] == "j1" and lines[0]["msg"] == "job j1 rejected: bad"
    assert lines[1]["event"] == "job_finished" and lines[1]["usage"] == {"n": 1}
    assert lines[1]["job_id"] == "j2" and len(lines) == 3
    assert "pw" not in lines[2]["msg"] and "boom" in lines[2]["exc"]


def test_text_lines_mask_passwords_too() -> None:
    stream = io.StringIO()
    logger_to(stream, RedactingFormatter(TEXT_FORMAT)).warning("redis://u:hunter2@h:1 is down")
    assert "hunter2" not in stream.getvalue() and "redis://u:***@h:1" in stream.getvalue()


def test_passwords_in_urls_are_masked() -> None:
    assert redact("redis://user:pa$$@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("at rediss://:secret@h:1 and unix:///run/r.sock") == (
        "at rediss://:***@h:1 and unix:///run/r.sock"
    )
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
