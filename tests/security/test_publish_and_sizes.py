"""Smaller promises: a resent write never republishes, a rejected entry's keys expire
even when the reply to their creation was lost, and an oversized payload is refused
before anything parses it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from batchd.config.limits import LimitSettings
from batchd.daemon.worker import pickup
from batchd.daemon.worker.fence import CREATE_ONLY, Fence, Outcome, Reply
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.producers.keys import JOB_FIELD, Keys
from batchd.producers.schema import parse_job
from support.redis_server import RedisServer

KEYS = Keys()


def test_a_resent_append_stores_and_publishes_nothing_again(redis_server: RedisServer) -> None:
    client = redis_server.client()
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.tokens("j1"))
    confirmed = pubsub.get_message(timeout=10)
    assert confirmed is not None and confirmed["type"] == "subscribe", confirmed
    job = Job(job_id="j1", delivery=Delivery("default", "1-0", {}))
    for token in (5, 6, 7):
        job.add_token(token, f"{token} ")
    fence = Fence(client, KEYS, owner="d1", result_ttl_s=60)
    fence.load(client)

    def append() -> Reply:
        pipe = client.pipeline(transaction=False)
        fence.queue(pipe, job)
        return Reply.parse(pipe.execute(raise_on_error=False)[0])

    assert append().outcome is Outcome.stored
    # The same step sent again (its reply was lost): the stream already holds it.
    assert append().outcome is Outcome.tip
    # A mark published after both appends: Redis delivers a channel's messages in the
    # order it ran their commands, so all the appends published comes before it (no sleep
    # that a loaded host could outlast).
    client.publish(KEYS.tokens("j1"), b"mark")
    published = []
    while (message := pubsub.get_message(timeout=10)) is not None and message["data"] != b"mark":
        published.append(orjson.loads(message["data"])["seq"])
    assert message is not None, f"the mark never came, after {published}"
    assert published == [0, 1, 2]
    assert client.xlen(KEYS.events("j1")) == 3


def test_a_rejected_entrys_keys_expire_though_the_reply_to_their_creation_was_lost(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    job = Job(job_id="bad", delivery=Delivery("default", "1-0", {}))
    job.epoch = CREATE_ONLY
    job.reject("payload did not parse")
    fence = Fence(client, KEYS, owner="d1", result_ttl_s=60)
    fence.load(client)
    pipe = client.pipeline(transaction=False)
    fence.queue(pipe, job)
    pipe.execute(raise_on_error=False)  # stored; suppose its reply never arrived
    pipe = client.pipeline(transaction=False)
    fence.queue(pipe, job)
    retry = Reply.parse(pipe.execute(raise_on_error=False)[0])
    assert retry.outcome is Outcome.lost  # the retry cannot tell its own keys from a job's
    assert 0 < client.ttl(KEYS.events("bad")) <= 60
    assert 0 < client.ttl(KEYS.job("bad")) <= 60


def test_an_oversized_payload_is_never_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = LimitSettings(max_message_bytes=10_000)
    parsed: list[int] = []
    real = orjson.loads

    def counting(data: Any) -> Any:
        parsed.append(len(data))
        return real(data)

    monkeypatch.setattr(pickup.orjson, "loads", counting)
    head = b'{"id": "big", "prompt": "'
    payload = head + b"x" * 1_000_000 + b'"}'
    job = pickup._parse(Delivery("default", "1-0", {JOB_FIELD.encode(): payload}), limits)
    assert job.job_id == "big"  # recovered from the payload's start only
    assert job.error is not None and "exceeds the limit 10000" in job.error
    assert all(size <= limits.max_message_bytes for size in parsed)
    with pytest.raises(Exception, match="exceeds the limit"):
        parse_job(payload, limits)


@pytest.mark.parametrize(
    ("payload", "job_id"),
    [
        (b'{"prompt": 5, "metadata": {"id": "someone"}}', "1-0"),  # not the job's id
        (b'{"id": "mine", "prompt": 5}', "mine"),
        (b'{"id": "mine\\n", "prompt": 5}', "1-0"),  # no trailing newline
        (b'{"id": "cut", "prompt": "never closed', "cut"),  # broken JSON: its start is searched
    ],
)
def test_a_rejected_payload_is_named_by_its_own_top_level_id_only(
    payload: bytes, job_id: str
) -> None:
    job = pickup._parse(Delivery("default", "1-0", {JOB_FIELD.encode(): payload}), LimitSettings())
    assert job.job_id == job_id and job.request is None
