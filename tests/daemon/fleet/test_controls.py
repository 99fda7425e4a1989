"""Pause, resume and drain a real ``batchd serve`` through its control hash.

The hash is written as the dashboard writes it (``intake``, ``drain``, ``at``, ``by``);
the daemon reads it on its heartbeat thread and says what it obeys in its heartbeat.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis

from batchd.daemon.fleet.controls import CONTROLS, Requested, Stop
from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import FinishReason, JobState
from support.daemon_harness import (
    DaemonProcess,
    daemon_config,
    status_of,
    wait_final,
    wait_until,
)
from support.redis_server import RedisServer

KEYS = Keys()
CONSUMER = "ctl-daemon"
# Long enough to be running while the test pauses, drains and checks.
LONG = 700


def _job(job_id: str, max_tokens: int) -> dict[str, Any]:
    return {
        "id": job_id,
        "prompt_token_ids": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def _beat(client: redis.Redis) -> dict[str, Any]:
    raw: Any = client.get(KEYS.daemon(CONSUMER))
    return orjson.loads(raw) if raw else {}


def _ask(client: redis.Redis, **fields: str) -> None:
    client.hset(KEYS.control(CONSUMER), mapping={**fields, "at": str(time.time()), "by": "test"})


def _started(client: redis.Redis, job_id: str) -> bool:
    return int(client.xlen(KEYS.events(job_id))) > 0


def _ended(client: redis.Redis, job_id: str) -> bool:
    return status_of(client, KEYS, job_id).state.terminal


def _unread(client: redis.Redis) -> int:
    groups: Any = client.xinfo_groups(KEYS.queue())
    return next(int(g["lag"]) for g in groups if g["name"].decode() == CONSUMER_GROUP)


def test_pause_holds_new_jobs_resume_takes_them_and_drain_exits(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    client = redis_server.client()
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(
        config, model=tiny_model, log_path=tmp_path / "d.log", consumer=CONSUMER
    ).wait_serving()
    try:
        with Client(redis_server.url) as producer:
            wait_until(
                lambda: bool(_beat(client).get("kv_blocks_total")), what="a beat with figures"
            )
            beat = _beat(client)
            assert beat["controls"] == list(CONTROLS)
            assert beat["paused"] is False and beat["draining"] is False
            assert beat["max_model_len"] > 0 and beat["version"]
            assert beat["kv_blocks_total"] > 0

            # Pause while a job runs: it finishes; a job submitted meanwhile stays queued.
            producer.submit_request(_job("held", LONG))
            wait_until(lambda: _started(client, "held"), timeout=30, what="held job running")
            _ask(client, intake="paused")
            wait_until(lambda: _beat(client).get("paused") is True, what="paused heartbeat")
            assert not _ended(client, "held"), "the held job ended before the pause: lengthen it"
            assert _beat(client)["kv_blocks_used"] > 0
            producer.submit_request(_job("waiting", 8))
            held = wait_final(client, KEYS, ["held"])["held"]
            assert held[-1].finish_reason == FinishReason.length
            assert len([e for e in held if e.token_id is not None]) == LONG
            time.sleep(0.5)  # several heartbeat and claim intervals of the test settings
            assert status_of(client, KEYS, "waiting").state == JobState.queued
            assert not _started(client, "waiting") and _unread(client) == 1

            # Resume: the waiting job is read and runs.
            _ask(client, intake="open", drain="0")
            wait_final(client, KEYS, ["waiting"], timeout=30)
            wait_until(lambda: _beat(client).get("paused") is False, what="resumed heartbeat")

            # Drain: the running job finishes, nothing new is taken, the daemon exits 0.
            producer.submit_request(_job("last", LONG))
            wait_until(lambda: _started(client, "last"), timeout=30, what="last job running")
            _ask(client, drain="1")
            wait_until(lambda: _beat(client).get("draining") is True, what="draining heartbeat")
            assert not _ended(client, "last"), "the last job ended before the drain: lengthen it"
            producer.submit_request(_job("left", 8))
            assert daemon.wait(60) == 0, daemon.log_tail()
    finally:
        daemon.kill()
    last = wait_final(client, KEYS, ["last"], timeout=1)["last"]
    assert len([e for e in last if e.token_id is not None]) == LONG
    assert status_of(client, KEYS, "left").state == JobState.queued and _unread(client) == 1
    assert client.get(KEYS.daemon(CONSUMER)) is None  # its heartbeat went with it
    assert client.hget(KEYS.control(CONSUMER), "drain") == b"0"  # its restart serves
    assert b"draining: intake closed" in daemon.log_path.read_bytes()


def test_requests_parse_as_the_dashboard_writes_them() -> None:
    assert Requested.from_hash({}) == Requested()
    assert Requested.from_hash({b"intake": b"paused", b"drain": b"0"}) == Requested(paused=True)
    assert Requested.from_hash({"intake": "open", "drain": "1"}) == Requested(drain=True)


def test_sigterm_during_a_drain_starts_the_grace_period() -> None:
    stop = Stop()
    assert stop.request(drain=True, grace_s=5.0)
    assert stop.draining and not stop.done(holding=True)  # no deadline: jobs finish
    assert not stop.request(drain=False, grace_s=5.0)
    assert 0 < stop.deadline - time.monotonic() <= 5.0
    assert not stop.request(drain=False, grace_s=5.0)
    assert stop.done(holding=True)  # a second SIGTERM: now
