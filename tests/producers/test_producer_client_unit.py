"""Client logic on fakeredis (no blocking reads) and the follow plan without Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest
import redis

from batchd.config.limits import LimitSettings
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.errors import JobFailed, JobNotFound, ProtocolError, ValidationError
from batchd.producers.follow import Delivery, FetchStatus, Follower, Pause, PlanDriver, Read
from batchd.producers.keys import CANCEL_FIELD, EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.result import collect
from batchd.producers.schema import Event, FinishReason, JobState, JobStatus, parse_job

KEYS = Keys()


def write_events(
    r: Any, job_id: str, text: str, reason: FinishReason | None, error: str | None = None
) -> None:
    """What a daemon leaves behind: one event per character, then the final event."""
    for seq, char in enumerate(text):
        event = Event(seq=seq, token_id=ord(char), text=char)
        r.xadd(KEYS.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    if reason is not None:
        final = Event(seq=len(text), finish_reason=reason, text=text, error=error)
        r.xadd(KEYS.events(job_id), {EVENT_FIELD: final.encode()}, id=event_id(len(text)))


def set_state(r: Any, job_id: str, state: JobState, **fields: str) -> None:
    r.hset(KEYS.job(job_id), mapping={"state": state.value, **fields})


@pytest.fixture
def client(fake_redis: fakeredis.FakeRedis) -> Client:
    return Client(fake_redis)


def test_submit_enqueues_job_and_status(client: Client, fake_redis: fakeredis.FakeRedis) -> None:
    handle = client.submit("hello", max_tokens=8, temperature=0.5, seed=3, metadata={"k": 1})
    assert len(handle.id) == 32
    [(_, fields)] = fake_redis.xrange(KEYS.queue("default"))
    job = parse_job(fields[JOB_FIELD.encode()])
    assert (job.id, job.prompt, job.max_tokens, job.seed) == (handle.id, "hello", 8, 3)
    assert job.metadata == {"k": 1}
    status = client.status(handle.id)
    assert (status.state, status.queue) == (JobState.queued, "default")
    assert status.queued_at is not None and abs(status.queued_at - time.time()) < 5


def test_submit_to_named_queue_with_messages(client: Client, fake_redis: Any) -> None:
    handle = client.submit(messages=[{"role": "user", "content": "hi"}], id="m1", queue="fast")
    assert (handle.id, handle.queue) == ("m1", "fast")
    assert fake_redis.xlen(KEYS.queue("fast")) == 1
    assert client.status("m1").queue == "fast"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "bogus": 1}, "bogus"),
        ({}, "job"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "job"),
        ({"prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_invalid_submit_writes_nothing(
    fake_redis: fakeredis.FakeRedis, kwargs: dict[str, Any], field: str
) -> None:
    client = Client(fake_redis, limits=LimitSettings())
    with pytest.raises(ValidationError) as err:
        client.submit(**kwargs)
    assert err.value.field == field
    assert fake_redis.dbsize() == 0


def test_job_id_seen_before_is_rejected_unless_idempotent(
    client: Client, fake_redis: fakeredis.FakeRedis
) -> None:
    client.submit("a", id="j1")
    with pytest.raises(ValidationError) as err:
        client.submit("a", id="j1")
    assert err.value.field == "id" and "already submitted (state queued)" in str(err.value)
    again = client.submit("a", id="j1", idempotent=True)
    assert again.id == "j1"
    assert fake_redis.xlen(KEYS.queue()) == 1


def test_cancel_sets_flag_and_notifies(client: Client, fake_redis: fakeredis.FakeRedis) -> None:
    handle = client.submit("a", id="c1")
    assert handle.cancel() is True
    assert client.status("c1").cancel_requested is True
    [(_, fields)] = fake_redis.xrange(KEYS.cancel)
    assert fields == {CANCEL_FIELD.encode(): b"c1"}
    set_state(fake_redis, "c1", JobState.finished)
    assert client.cancel("c1") is False
    assert fake_redis.xlen(KEYS.cancel) == 1
    with pytest.raises(JobNotFound):
        client.cancel("nope")
    assert not fake_redis.exists(KEYS.job("nope"))


def test_status_of_unknown_job(client: Client) -> None:
    with pytest.raises(JobNotFound) as err:
        client.status("ghost")
    assert err.value.job_id == "ghost"


def test_stream_and_result_from_a_finished_job(client: Client, fake_redis: Any) -> None:
    write_events(fake_redis, "done", "hello", FinishReason.length)
    events = list(client.handle("done").stream())
    assert [e.seq for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e.seq for e in client.stream("done", after_seq=2)] == [3, 4, 5]
    result = client.result("done", timeout=5)
    assert (result.text, result.finish_reason) == ("hello", FinishReason.length)
    assert result.token_ids == [ord(c) for c in "hello"]


@pytest.mark.parametrize(
    "reason", [FinishReason.error, FinishReason.cancelled, FinishReason.expired]
)
def test_result_raises_when_the_job_did_not_finish(
    client: Client, fake_redis: Any, reason: FinishReason
) -> None:
    write_events(fake_redis, "bad", "ab", reason, error="boom")
    with pytest.raises(JobFailed) as err:
        client.result("bad")
    assert (err.value.job_id, err.value.reason) == ("bad", reason.value)


def test_job_ended_without_final_event(client: Client, fake_redis: Any) -> None:
    """A dead-lettered job has only its status: the stream ends from the status."""
    set_state(fake_redis, "dead", JobState.failed, error="poison after 5 deliveries")
    events = list(client.stream("dead"))
    assert [(e.seq, e.finish_reason) for e in events] == [(0, FinishReason.error)]
    with pytest.raises(JobFailed, match="poison after 5 deliveries"):
        client.result("dead")
    write_events(fake_redis, "gone", "ab", None)
    set_state(fake_redis, "gone", JobState.finished)
    with pytest.raises(JobFailed, match="expired before they were read"):
        client.result("gone")


def test_given_connection_must_outlast_block(fake_redis: fakeredis.FakeRedis) -> None:
    short = redis.Redis(socket_timeout=0.5)
    with pytest.raises(ValueError, match="socket_timeout"):
        Client(short, block_ms=1000)
    assert Client(short, block_ms=100).block_ms == 100
    short.close()


def test_async_client_round_trip() -> None:
    server = fakeredis.FakeServer()
    sync_view = fakeredis.FakeRedis(server=server)

    async def scenario() -> None:
        async with AsyncClient(fakeredis.FakeAsyncRedis(server=server)) as client:
            handle = await client.submit("hey", id="a1", max_tokens=3)
            with pytest.raises(ValidationError):
                await client.submit("hey", id="a1")
            assert (await client.submit("hey", id="a1", idempotent=True)).id == "a1"
            assert (await handle.status()).state is JobState.queued
            assert await handle.cancel() is True
            write_events(sync_view, "a1", "hey", FinishReason.stop)
            assert [e.seq async for e in handle.stream()] == [0, 1, 2, 3]
            assert (await handle.result(timeout=5)).text == "hey"

    asyncio.run(scenario())
    assert sync_view.xlen(KEYS.queue()) == 1 and sync_view.xlen(KEYS.cancel) == 1


# The plan, driven by hand: each step is checked, replies are made up.


def entries(*seqs: int, job: str = "j") -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [
        (event_id(s).encode(), {b"event": Event(seq=s, token_id=s, text="x").encode()})
        for s in seqs
    ]


def test_plan_skips_duplicates_and_refuses_gaps() -> None:
    follower = Follower(KEYS)
    follower.add("j")
    plan = follower.plan()
    step = next(plan)
    assert step == Read({KEYS.events("j"): "0-0"}, None)
    step = plan.send({KEYS.events("j"): entries(0, 1)})
    assert step == Delivery("j", Event(seq=0, token_id=0, text="x"))
    assert plan.send(None).event.seq == 1  # type: ignore[union-attr]
    step = plan.send(None)
    assert step == Read({KEYS.events("j"): event_id(1)}, None)
    step = plan.send({KEYS.events("j"): entries(1, 2)})  # 1 again: dropped
    assert step.event.seq == 2  # type: ignore[union-attr]
    plan.send(None)
    with pytest.raises(ProtocolError, match="jump from seq 3 to 5"):
        plan.send({KEYS.events("j"): entries(5)})


def test_plan_resumes_after_connection_loss() -> None:
    follower = Follower(KEYS, reconnect_timeout_s=60)
    follower.add("j", after_seq=4)
    plan = follower.plan()
    assert next(plan) == Read({KEYS.events("j"): event_id(4)}, None)
    step = plan.send({})  # caught up: the status is checked next
    assert step == FetchStatus([KEYS.job("j")])
    step = plan.send([JobStatus(state=JobState.running).to_hash()])
    assert step == Read({KEYS.events("j"): event_id(4)}, 1000)  # live: blocking read
    pause = plan.throw(redis.ConnectionError("killed"))
    assert isinstance(pause, Pause) and pause.seconds == pytest.approx(0.05)
    assert plan.send(None) == Read({KEYS.events("j"): event_id(4)}, None)  # catch up again
    assert isinstance(plan.throw(redis.TimeoutError("again")), Pause)
    step = plan.send(None)
    final = Event(seq=5, finish_reason=FinishReason.stop)
    step = plan.send({KEYS.events("j"): [(event_id(5).encode(), {b"event": final.encode()})]})
    assert step == Delivery("j", final)
    with pytest.raises(StopIteration):
        plan.send(None)


def test_plan_gives_up_after_reconnect_timeout() -> None:
    follower = Follower(KEYS, reconnect_timeout_s=0.0)
    follower.add("j")
    plan = follower.plan()
    next(plan)
    assert isinstance(plan.throw(redis.ConnectionError("down")), Pause)
    plan.send(None)
    time.sleep(0.01)
    with pytest.raises(redis.ConnectionError, match="down"):
        plan.throw(redis.ConnectionError("down"))


def test_driver_retries_an_unblocked_read_and_raises_other_refusals() -> None:
    """UNBLOCKED (a failover ended the blocking read) resumes like a dropped connection;
    any other error reply reaches the caller, on a read or a status fetch alike."""
    follower = Follower(KEYS, reconnect_timeout_s=60)
    follower.add("j")
    driver = PlanDriver(follower.plan())
    assert isinstance(driver.next_step(), Read)
    driver.failed(redis.ResponseError("UNBLOCKED force unblock from blocking operation"))
    assert isinstance(driver.next_step(), Pause)
    assert isinstance(driver.next_step(), Read)
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        driver.failed(redis.ResponseError("NOPERM no permissions to run 'xread'"))
    driver.answered([])  # an empty XREAD reply is parsed as no entries
    assert driver.next_step() == FetchStatus([KEYS.job("j")])
    with pytest.raises(redis.ResponseError, match="UNBLOCKED"):
        driver.failed(redis.ResponseError("UNBLOCKED not a read"))


def test_events_without_a_final_event_are_a_protocol_error() -> None:
    events = [Event(seq=0, token_id=1, text="a")]
    with pytest.raises(ProtocolError, match="without a final event"):
        collect("j", events)
