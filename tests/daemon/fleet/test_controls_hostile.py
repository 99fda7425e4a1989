"""A real ``batchd serve`` whose control hash holds what no dashboard writes.

Anyone with write access to Redis can write ``<prefix>:control:<consumer>``: fields and
values the daemon does not know, megabytes, bytes that are no UTF-8, a string or a list
instead of a hash, or a read refused by an ACL. The daemon serves on through each, warns
once per problem (naming the key, quoting only a few characters), and obeys a valid
request written afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis

from batchd.producers.client import Client
from batchd.producers.keys import Keys
from batchd.producers.schema import JobState
from support.daemon_harness import DaemonProcess, daemon_config, status_of, wait_final, wait_until
from support.redis_server import RedisServer

KEYS = Keys()
CONSUMER = "hostile-daemon"
CONTROL = KEYS.control(CONSUMER)
MB = 1 << 20
# Many heartbeat intervals of the test settings: a warning repeated per beat would show.
BEATS_S = 0.8


def _beat(client: redis.Redis) -> dict[str, Any]:
    raw: Any = client.get(KEYS.daemon(CONSUMER))
    return orjson.loads(raw) if raw else {}


def _start(tmp_path: Path, redis_url: str, model: Path) -> DaemonProcess:
    config = daemon_config(tmp_path, redis_url)
    log_path = tmp_path / "d.log"
    return DaemonProcess(config, model=model, log_path=log_path, consumer=CONSUMER).wait_serving(30)


def _named(daemon: DaemonProcess) -> list[str]:
    """The log's lines that name the control key."""
    lines = daemon.log_path.read_bytes().decode(errors="replace").splitlines()
    return [line for line in lines if CONTROL in line]


def _warnings(daemon: DaemonProcess) -> list[str]:
    return [line for line in _named(daemon) if " WARNING " in line]


def _beats(daemon: DaemonProcess) -> list[str]:
    """The log's lines that name the heartbeat key."""
    lines = daemon.log_path.read_bytes().decode(errors="replace").splitlines()
    return [line for line in lines if f"heartbeat {KEYS.daemon(CONSUMER)} " in line]


def _serves(producer: Client, client: redis.Redis, job_id: str) -> None:
    producer.submit_request({"id": job_id, "prompt_token_ids": [5, 6, 7], "max_tokens": 4})
    wait_final(client, KEYS, [job_id], timeout=15)


# Each writes one hostile control key over what was there (deleted first).
HOSTILE: dict[str, Callable[[redis.Redis], Any]] = {
    "unknown field": lambda c: c.hset(CONTROL, mapping={"colour": "blue", "at": "1"}),
    "a string": lambda c: c.set(CONTROL, "paused"),
    "unknown states": lambda c: c.hset(CONTROL, mapping={"intake": "sideways", "drain": "2"}),
    "a list": lambda c: c.rpush(CONTROL, "intake", "paused"),
    "huge values": lambda c: c.hset(CONTROL, mapping={"intake": "x" * MB, "y" * MB: "z"}),
    "not UTF-8": lambda c: c.hset(CONTROL, mapping={"intake": b"\xff\xfe", b"\xc3\x28": b"\x80"}),
}


def test_hostile_control_values_are_warned_once_and_serving_goes_on(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    client = redis_server.client()
    client.set(CONTROL, "not a hash")  # there before the daemon starts: it starts all the same
    daemon = _start(tmp_path, redis_server.url, tiny_model)
    try:
        with Client(redis_server.url) as producer:
            _serves(producer, client, "at-start")
            assert len(_warnings(daemon)) == 1, _warnings(daemon)
            assert "WRONGTYPE" in _warnings(daemon)[0]
            for n, (case, write) in enumerate(HOSTILE.items()):
                before = len(_warnings(daemon))
                client.delete(CONTROL)
                write(client)
                wait_until(
                    lambda before=before: len(_warnings(daemon)) > before, what=f"{case} warned"
                )
                _serves(producer, client, f"job-{n}")
                time.sleep(BEATS_S)
                assert len(_warnings(daemon)) == before + 1, (case, _warnings(daemon)[before:])
                assert _beat(client).get("paused") is False, case
            assert all(len(line) < 1000 for line in _named(daemon)), "a hostile value quoted"

            # A valid pause written afterwards is obeyed (and the key said readable again).
            client.delete(CONTROL)
            client.hset(CONTROL, mapping={"intake": "paused", "at": "1", "by": "test"})
            wait_until(lambda: _beat(client).get("paused") is True, what="paused heartbeat")
            assert "readable again" in " ".join(_named(daemon)[-2:])
            producer.submit_request({"id": "held", "prompt_token_ids": [5], "max_tokens": 4})
            time.sleep(BEATS_S)
            assert status_of(client, KEYS, "held").state == JobState.queued
            client.hset(CONTROL, "intake", "open")
            wait_final(client, KEYS, ["held"], timeout=15)
    finally:
        daemon.kill()


def test_a_refused_control_read_keeps_the_last_request_and_recovers(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    """An ACL user that may HGETALL job hashes only: every control read is refused
    (NOPERM), the daemon serves on under the last request read, and obeys again once the
    read is allowed; then the same for its heartbeat's SET."""
    admin = redis_server.client()
    admin.execute_command(
        "ACL", "SETUSER", "daemon", "on", ">pw", "~*", "&*", "+@all", "-hgetall",
        f"(+hgetall ~{KEYS.prefix}:job:*)",
    )  # fmt: skip
    url = redis_server.url.replace("redis://", "redis://daemon:pw@")
    daemon = _start(tmp_path, url, tiny_model)
    try:
        with Client(redis_server.url) as producer:
            _serves(producer, admin, "refused")
            assert len(_warnings(daemon)) == 1 and "NoPermissionError" in _warnings(daemon)[0]
            admin.hset(CONTROL, "intake", "paused")  # not read: the daemon serves on
            _serves(producer, admin, "unseen-pause")
            time.sleep(BEATS_S)
            assert len(_warnings(daemon)) == 1, _warnings(daemon)

            admin.execute_command("ACL", "SETUSER", "daemon", "+hgetall")
            wait_until(lambda: _beat(admin).get("paused") is True, what="paused heartbeat")
            assert "readable again" in " ".join(_named(daemon)[-2:])
            admin.hset(CONTROL, "intake", "open")
            _serves(producer, admin, "resumed")

            # The heartbeat's SET refused (the daemon SETs nothing else): its key lapses,
            # the daemon serves on, says so once, and beats again once allowed.
            admin.execute_command("ACL", "SETUSER", "daemon", "-set")
            wait_until(lambda: not _beat(admin), what="the heartbeat lapsed")
            _serves(producer, admin, "unbeaten")
            time.sleep(BEATS_S)
            failed = [line for line in _beats(daemon) if " failed: " in line]
            assert len(failed) == 1, failed
            admin.execute_command("ACL", "SETUSER", "daemon", "+set")
            wait_until(lambda: bool(_beat(admin)), what="the heartbeat back")
            # Said once the beat is written: the log line can trail the key by a moment.
            wait_until(lambda: "restored" in _beats(daemon)[-1], what="the heartbeat restored")
            _serves(producer, admin, "beaten")
    finally:
        daemon.kill()
