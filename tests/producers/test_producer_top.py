"""``batchd top`` against a real redis-server and a real daemon loop (no model).

The daemon is the real Worker with its real heartbeat, driving an engine
stand-in that keeps every job running; top reads Redis as a user whose ACL
allows reads only and forbids KEYS, so it is read-only and SCANs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from batchd.config.settings import Settings, load_settings
from batchd.daemon.cli import main
from batchd.daemon.worker.generator import Generator, JobStart
from batchd.daemon.worker.loop import Worker
from batchd.engine.outputs import FinishReason, RequestOutput, StepStats
from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import JobRequest
from support.redis_server import RedisServer

KEYS = Keys()


class HoldingGenerator(Generator):
    """An engine stand-in under steady load: every job runs forever, one token per step."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.steps = 0

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        return [ord(c) % 256 for c in request.prompt or "x"]

    def start(self, job: JobStart) -> FinishReason | None:
        self.running.append(job.job_id)
        return None

    def abort(self, job_id: str) -> None:
        self.running.remove(job_id)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.02)
        self.steps += 1
        return [RequestOutput(job_id, 7, "x", 0.0, self.steps - 1) for job_id in self.running]

    def has_work(self) -> bool:
        return bool(self.running)

    def stats(self) -> StepStats:
        # A quarter of the KV pool in use.
        return StepStats(
            step=self.steps, num_running=len(self.running), kv_blocks_used=1, kv_blocks_total=4
        )


@contextmanager
def serving(settings: Settings) -> Iterator[None]:
    """The daemon loop on a thread (built there, as the engine thread is), stopped on exit."""
    box: dict[str, Worker] = {}
    ready = threading.Event()

    def run() -> None:
        try:
            box["worker"] = Worker(settings, HoldingGenerator(), consumer="top-worker")
        finally:
            ready.set()
        box["worker"].run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30) and "worker" in box
    try:
        yield
    finally:
        box["worker"].request_stop()
        box["worker"].request_stop()
        thread.join(30)
        assert not thread.is_alive()


def read_only_url(server: RedisServer) -> str:
    server.client().acl_setuser(
        "top",
        enabled=True,
        passwords=["+secret"],
        keys=["*"],
        commands=["+@read", "+@connection", "-keys"],
    )
    return f"redis://top:secret@127.0.0.1:{server.port}/0"


def run_top(capsys: pytest.CaptureFixture[str], url: str, *options: str) -> tuple[int, str]:
    code = main(["--redis-url", url, "top", "--once", *options])
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


def wait_for(predicate: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_top_shows_daemons_and_queues(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis_server.client()
    settings = load_settings(
        redis_url=redis_server.url,
        model="tiny-test",
        engine={"max_num_seqs": 2},
        daemon={
            "heartbeat_interval_s": 0.1,
            "heartbeat_ttl_s": 2.0,
            "block_ms": 100,
            "intake_buffer": 0,
        },
    )
    # A queue no live daemon serves, whose only consumer died holding one entry.
    spare = KEYS.queue("spare")
    client.xgroup_create(spare, CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(spare, {"job": "{}"})
    client.xreadgroup(CONSUMER_GROUP, "gone-daemon", {spare: ">"}, count=1)
    url = read_only_url(redis_server)

    with serving(settings), Client(redis_server.url) as producer:
        for i in range(3):
            producer.submit(f"job {i}", max_tokens=4000)

        def busy() -> bool:
            beat = json.loads(client.get(KEYS.daemon("top-worker")) or b"{}")
            return beat.get("running") == 2 and beat.get("tokens_per_s", 0) > 0

        wait_for(busy, "the daemon running two jobs")
        _, out = run_top(capsys, url, "--json")
        snapshot = json.loads(out)
        _, text = run_top(capsys, url)

    [daemon] = snapshot["daemons"]
    assert daemon["consumer"] == "top-worker"
    assert daemon["model"] == "tiny-test"
    assert daemon["queues"] == ["default"]
    assert (daemon["running"], daemon["waiting"], daemon["jobs_held"]) == (2, 0, 2)
    assert daemon["kv_usage"] == 0.25
    assert daemon["tokens_per_s"] > 0
    assert 0 <= daemon["age_s"] < 2
    queues = {q["name"]: q for q in snapshot["queues"]}
    # The daemon reads default's priority lane too (a stream of its own): shown, empty.
    assert set(queues) == {"default", "default.priority", "spare"}
    assert queues["default.priority"]["length"] == 0
    default = queues["default"]
    assert (default["length"], default["pending"], default["unread"]) == (3, 2, 1)
    assert [(c["name"], c["pending"], c["alive"]) for c in default["consumers"]] == [
        ("top-worker", 2, True)
    ]
    assert (queues["spare"]["length"], queues["spare"]["pending"]) == (1, 1)
    assert [(c["name"], c["alive"]) for c in queues["spare"]["consumers"]] == [
        ("gone-daemon", False)
    ]

    assert "1 daemon(s)" in text
    [row] = [line.split() for line in text.splitlines() if line.startswith("top-worker")]
    assert row[:7] == ["top-worker", "tiny-test", "default", "up", "2", "0", "25%"]
    assert float(row[7]) > 0 and row[8] == "2" and row[-1] == "ago"
    assert "gone-daemon (1 pending, no heartbeat)" in text
    assert "top-worker (2 pending)" in text

    # A clean stop removes the heartbeat: no live daemon left, the jobs stay pending.
    _, out = run_top(capsys, url, "--json")
    after = json.loads(out)
    assert after["daemons"] == []
    pending = {q["name"]: q["pending"] for q in after["queues"]}
    assert pending == {"default": 2, "default.priority": 0, "spare": 1}


def test_top_without_redis_exits_3(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = redis_server.url
    redis_server.kill()
    assert main(["--redis-url", url, "top", "--once"]) == 3
    assert "cannot reach Redis" in capsys.readouterr().err
