"""``batchd serve`` under a fake systemd: READY, STATUS, WATCHDOG only while the loop turns.

The daemon runs as a subprocess on the tiny model with ``NOTIFY_SOCKET`` pointed
at a datagram socket of the test; support.faulty_serve makes its engine hang or fail
after a number of steps.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchd.daemon.fleet.heartbeat import EXIT_STALLED
from batchd.producers.keys import Keys
from support.daemon_harness import DaemonProcess, daemon_config, enqueue, wait_until
from support.redis_server import RedisServer

KEYS = Keys()
WATCHDOG_USEC = 200_000  # pings every 0.1 s


class NotifyListener:
    """A systemd stand-in: records every notification with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            now = time.monotonic()
            self.messages += [(now, line) for line in data.decode().splitlines()]

    def times(self, line: str, *, after: float = 0.0) -> list[float]:
        return [t for t, got in list(self.messages) if got == line and t > after]

    def first(self, line: str, timeout: float) -> float:
        wait_until(lambda: bool(self.times(line)), timeout=timeout, what=line)
        return self.times(line)[0]

    def statuses(self) -> list[str]:
        return [got for _, got in list(self.messages) if got.startswith("STATUS=")]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[NotifyListener]:
    # A short path: AF_UNIX addresses are limited to ~107 bytes, pytest's tmp paths are long.
    with tempfile.TemporaryDirectory(prefix="batchd-notify-") as folder:
        got = NotifyListener(Path(folder) / "notify.sock")
        yield got
        got.close()


def start(
    tmp_path: Path,
    redis_server: RedisServer,
    tiny_model: Path,
    listener: NotifyListener,
    fault: list[str],
) -> DaemonProcess:
    env = {"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    config = daemon_config(tmp_path, redis_server.url)
    return DaemonProcess(
        config, model=tiny_model, log_path=tmp_path / "d.log", env=env, faults=fault
    )


def test_watchdog_pings_while_idle_and_busy_and_stop_when_the_engine_hangs(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, listener: NotifyListener
) -> None:
    client = redis_server.client()
    daemon = start(tmp_path, redis_server, tiny_model, listener, ["--hang", "250"])
    try:
        ready = listener.first("READY=1", timeout=60)
        wait_until(lambda: len(listener.times("WATCHDOG=1", after=ready)) >= 3, what="idle pings")
        assert any("0 running" in s for s in listener.statuses()), listener.statuses()

        for i in range(4):  # ~300 steps of a few ms: the engine hangs at step 250
            job = {"id": f"w{i}", "prompt_token_ids": [5, 6, 7], "max_tokens": 300}
            enqueue(client, KEYS, {**job, "ignore_eos": True})
        wait_until(lambda: client.exists(KEYS.events("w0")) == 1, timeout=30, what="first token")
        busy = time.monotonic()
        wait_until(lambda: b"engine thread hangs" in daemon.log_path.read_bytes(), timeout=60)
        hung = time.monotonic()
        assert listener.times("WATCHDOG=1", after=busy), "no watchdog ping while busy"

        # A ping sent just before the hang may still be on its way: allow 0.3 s for it.
        time.sleep(0.3)
        time.sleep(10 * WATCHDOG_USEC / 1e6)  # ten ping periods
        late = listener.times("WATCHDOG=1", after=hung + 0.3)
        assert not late, "pings went on from a hung engine"
        assert daemon.proc.poll() is None  # hung, not gone: only the watchdog can tell
        # What systemd does at WatchdogSec= (WatchdogSignal=SIGABRT): the exit is a failure.
        daemon.signal(signal.SIGABRT)
        assert daemon.wait(30) != 0
    finally:
        daemon.kill()
        client.close()


def test_an_engine_that_dies_exits_non_zero(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, listener: NotifyListener
) -> None:
    client = redis_server.client()
    daemon = start(tmp_path, redis_server, tiny_model, listener, ["--raise", "3"])
    try:
        listener.first("READY=1", timeout=60)
        enqueue(client, KEYS, {"id": "x", "prompt_token_ids": [5, 6, 7], "max_tokens": 20})
        assert daemon.wait(60) == 1, daemon.log_tail()
        assert "daemon failed: test fault after step 3" in daemon.log_tail()
        wait_until(
            lambda: "STATUS=failed: EngineFailure: test fault after step 3" in listener.statuses()
        )
    finally:
        daemon.kill()
        client.close()


def test_a_hung_engine_exits_by_itself_where_no_watchdog_watches(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, listener: NotifyListener
) -> None:
    """Under launchd (or a bare shell) nobody sends SIGABRT: the stall rule exits non-zero."""
    client = redis_server.client()
    env = {"NOTIFY_SOCKET": str(listener.path)}
    config = daemon_config(tmp_path, redis_server.url, stall_timeout_s=2.0)
    daemon = DaemonProcess(
        config, model=tiny_model, log_path=tmp_path / "d.log", env=env, faults=["--hang", "20"]
    )
    try:
        listener.first("READY=1", timeout=60)
        enqueue(client, KEYS, {"id": "w", "prompt_token_ids": [5, 6, 7], "max_tokens": 100})
        assert daemon.wait(60) == EXIT_STALLED, daemon.log_tail()
    finally:
        daemon.kill()
        client.close()
