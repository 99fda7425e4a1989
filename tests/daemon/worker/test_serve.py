"""``batchd serve`` as a subprocess on the tiny model: many producers, and bad input."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import redis

from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, JOB_FIELD, Keys
from batchd.producers.schema import Event, FinishReason, JobState
from support.daemon_harness import (
    DaemonProcess,
    Reference,
    daemon_config,
    enqueue,
    mixed_jobs,
    status_of,
    token_ids,
    wait_final,
)
from support.redis_server import RedisServer

KEYS = Keys()


class ChannelRecorder:
    """PSUBSCRIBEs to every job's token channel and records the seqs each job got."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(KEYS.tokens_pattern)
        self.seqs: dict[str, list[int]] = {}
        # Each job's token events as a subscriber read them: (seq, token id).
        self.tokens: dict[str, list[tuple[int, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.05)
            if message is None:
                continue
            job_id = message["channel"].decode().split(":")[2]
            event = Event.decode(message["data"])
            self.seqs.setdefault(job_id, []).append(event.seq)
            if event.token_id is not None:
                self.tokens.setdefault(job_id, []).append((event.seq, event.token_id))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()
        self.client.close()


def test_hundred_jobs_from_four_producers(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference: Reference
) -> None:
    jobs = mixed_jobs(100, prefix="m", seed=1)
    expected = reference(jobs)
    client = redis_server.client()
    recorder = ChannelRecorder(redis_server.url)
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log").wait_serving()
    try:

        def produce(part: list[dict[str, Any]]) -> None:
            with Client(redis_server.url) as producer:
                for job in part:
                    producer.submit_request(job)

        threads = [threading.Thread(target=produce, args=(jobs[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = wait_final(client, KEYS, list(expected), timeout=90)
    finally:
        daemon.signal(15)
        assert daemon.wait(30) == 0, daemon.log_tail()
        recorder.close()
    for job_id, tokens in expected.items():
        events = done[job_id]
        assert token_ids(events) == tokens, job_id
        assert recorder.seqs[job_id] == list(range(len(events))), job_id
        assert status_of(client, KEYS, job_id).state is JobState.finished
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0


BAD_INPUTS: list[tuple[str, bytes | None, str]] = [
    # (job id to look for, payload (None: no job field), expected words in the error)
    ("b-json", b'{"id": "b-json", "prompt": ', "invalid JSON"),
    ("b-type", orjson.dumps({"id": "b-type", "prompt": "x", "max_tokens": "ten"}), "max_tokens"),
    (
        "b-field",
        orjson.dumps({"id": "b-field", "prompt": "x", "colour": 1}),
        "colour: unknown field",
    ),
    (
        "b-model",
        orjson.dumps({"id": "b-model", "prompt": "x", "model": "gpt"}),
        "model: unknown field",
    ),
    ("b-chars", orjson.dumps({"id": "b-chars", "prompt": "y" * 3000}), "prompt: 3000 characters"),
    ("b-tokens", orjson.dumps({"id": "b-tokens", "prompt": "z " * 400}), "tokens exceed the limit"),
    ("b-vocab", orjson.dumps({"id": "b-vocab", "prompt_token_ids": [5, 99999]}), "vocabulary"),
    ("b-big", orjson.dumps({"id": "b-big", "prompt": "x" * 10_000_000}), "exceeds the limit"),
    ("b-utf8", b'{"id": "b-utf8", "prompt": "\xff\xfe"}', "not UTF-8"),
    ("", None, "missing field 'job'"),
]


def test_bad_input_fails_cleanly_and_the_next_job_runs(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    client = redis_server.client()
    limits = {"max_prompt_chars": 2000, "max_prompt_tokens": 300}
    config = daemon_config(tmp_path, redis_server.url, limits=limits)
    daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log").wait_serving()
    try:
        ids = []
        for job_id, payload, _ in BAD_INPUTS:
            fields = {JOB_FIELD: payload} if payload is not None else {"jab": b"{}"}
            entry: bytes = client.xadd(KEYS.queue(), fields)  # type: ignore[assignment]
            ids.append(job_id or entry.decode())
        good = enqueue(client, KEYS, {"id": "good", "prompt": "hello", "max_tokens": 5})
        assert good
        done = wait_final(client, KEYS, ids + ["good"], timeout=30)
        assert daemon.proc.poll() is None
    finally:
        daemon.signal(15)
        assert daemon.wait(30) == 0, daemon.log_tail()
    dead: Any = client.xrange(KEYS.dead)
    dead_errors = {fields[b"id"].decode(): fields[b"error"].decode() for _, fields in dead}
    for job_id, (_, _, words) in zip(ids, BAD_INPUTS, strict=True):
        [final] = done[job_id]
        assert final.finish_reason is FinishReason.error
        assert final.error is not None and words in final.error, (job_id, final.error)
        status = status_of(client, KEYS, job_id)
        assert status.state is JobState.failed and status.error == final.error
        assert words in dead_errors[job_id]
    assert len(dead_errors) == len(BAD_INPUTS)
    assert len(token_ids(done["good"])) == 5
    assert done["good"][-1].finish_reason is FinishReason.length
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0
