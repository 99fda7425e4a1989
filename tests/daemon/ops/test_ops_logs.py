"""``batchd serve --log-format json``: every line a JSON object, each job's life in a few."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import redis

from batchd.producers.keys import JOB_FIELD, Keys
from support.daemon_harness import DaemonProcess, daemon_config, enqueue, wait_final
from support.redis_server import RedisServer

KEYS = Keys()


def test_json_log_lines_tell_each_jobs_life(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    # A password in the Redis URL must never reach a log line.
    redis_server.client().config_set("requirepass", "s3cret-pw")
    url = redis_server.url.replace("redis://", "redis://default:s3cret-pw@")
    client = redis.Redis.from_url(url)
    config = daemon_config(tmp_path, url)
    daemon = DaemonProcess(
        config,
        model=tiny_model,
        log_path=tmp_path / "d.log",
        extra_args=["--log-format", "json"],  # a global option, after the subcommand
    ).wait_serving()
    try:
        for i in range(2):
            enqueue(client, KEYS, {"id": f"ok{i}", "prompt": "hello", "max_tokens": 24})
        client.xadd(KEYS.queue(), {JOB_FIELD: b'{"id": "bad", "prompt": '})
        wait_final(client, KEYS, ["ok0", "ok1", "bad"], timeout=60)
    finally:
        daemon.signal(15)
        assert daemon.wait(30) == 0, daemon.log_tail()
        client.close()

    text = daemon.log_path.read_text()
    assert "s3cret-pw" not in text
    lines: list[dict[str, Any]] = [orjson.loads(line) for line in text.splitlines() if line]
    assert all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    events = [line.get("event") for line in lines]
    for event in ("daemon_starting", "model_loaded", "serving", "stopped"):
        assert event in events, events
    assert events.index("model_loaded") < events.index("serving") < events.index("stopped")

    for job_id in ("ok0", "ok1"):
        mine = [line for line in lines if line.get("job_id") == job_id]
        assert [line["event"] for line in mine] == ["job_started", "job_finished"], mine
        end = mine[-1]
        assert end["completion_tokens"] == 24 and end["prompt_tokens"] > 0
        assert end["state"] == "finished" and end["finish_reason"] in ("stop", "length")
        assert end["ttft_s"] >= 0 and end["duration_s"] >= end["ttft_s"] - end["queued_s"]
    bad = [line for line in lines if line.get("job_id") == "bad"]
    assert bad[-1]["event"] == "job_failed" and bad[-1]["level"] == "WARNING"
    assert "invalid JSON" in bad[-1]["error"]
