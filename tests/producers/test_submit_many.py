"""submit_many: several jobs in one round trip, all or none, on a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from batchd.producers.aio import AsyncClient
from batchd.producers.base import MAX_SUBMIT_MANY
from batchd.producers.client import Client
from batchd.producers.errors import ValidationError
from batchd.producers.keys import CONSUMER_GROUP, JOB_FIELD, Keys
from batchd.producers.schema import JobRequest, JobState, parse_job
from support.redis_server import RedisServer
from support.text_daemon import expected_text, text_daemon

KEYS = Keys()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Client]:
    with Client(redis_server.url, block_ms=200) as c:
        yield c


def queued_ids(r: redis.Redis, queue: str = "default") -> list[str]:
    return [parse_job(f[JOB_FIELD.encode()]).id or "" for _, f in r.xrange(KEYS.queue(queue))]


def test_jobs_are_queued_in_order_with_their_status(
    client: Client, redis_client: redis.Redis
) -> None:
    jobs: list[Any] = [
        {"prompt": "a", "max_tokens": 3, "id": "m1"},
        JobRequest(prompt="b", max_tokens=4, id="m2"),
        {"prompt": "c", "max_tokens": 5},
    ]
    handles = client.submit_many(jobs, queue="bulk")
    assert [h.id for h in handles][:2] == ["m1", "m2"] and len(handles[2].id) == 32
    assert {h.queue for h in handles} == {"bulk"}
    assert queued_ids(redis_client, "bulk") == [h.id for h in handles]
    for handle in handles:
        status = handle.status()
        assert (status.state, status.queue) == (JobState.queued, "bulk")
        assert status.queued_at is not None


def test_a_waiting_reader_gets_every_job_at_once(
    redis_server: RedisServer, client: Client, redis_client: redis.Redis
) -> None:
    """What a daemon blocked on the queue sees: the whole call in one read, where a loop
    of single submits wakes it for the first job alone."""
    reads: dict[str, int] = {}

    def read(queue: str) -> None:
        with redis.Redis.from_url(redis_server.url) as reader:
            reply = reader.xreadgroup(CONSUMER_GROUP, "d1", {queue: ">"}, count=100, block=5000)
            reads[queue] = sum(len(entries) for _, entries in reply)

    submits: dict[str, Callable[[list[Any]], object]] = {
        "one": lambda jobs: [client.submit_request(job, queue="one") for job in jobs],
        "many": lambda jobs: client.submit_many(jobs, queue="many"),
    }
    for name, submit in submits.items():
        redis_client.xgroup_create(KEYS.queue(name), CONSUMER_GROUP, id="0", mkstream=True)
        reader = threading.Thread(target=read, args=(KEYS.queue(name),))
        reader.start()
        _wait_blocked(redis_client)
        submit([{"prompt": f"{name} {i}", "max_tokens": 2} for i in range(5)])
        reader.join(timeout=10)
    assert reads == {KEYS.queue("one"): 1, KEYS.queue("many"): 5}


def _wait_blocked(r: redis.Redis) -> None:
    for _ in range(500):
        if int(r.info("clients")["blocked_clients"]) > 0:
            return
        time.sleep(0.01)
    raise AssertionError("the reader never blocked")


def test_a_job_submitted_before_makes_the_whole_call_write_nothing(
    client: Client, redis_client: redis.Redis
) -> None:
    client.submit("first", id="taken", max_tokens=2)
    with pytest.raises(ValidationError) as caught:
        client.submit_many(
            [{"prompt": "x", "id": "new1"}, {"prompt": "y", "id": "taken"}, {"prompt": "z"}]
        )
    assert caught.value.field == "id" and "taken" in str(caught.value)
    assert "queued" in str(caught.value)
    assert queued_ids(redis_client) == ["taken"]
    assert not redis_client.exists(KEYS.job("new1"))


def test_idempotent_attaches_to_existing_jobs_and_queues_the_rest(
    client: Client, redis_client: redis.Redis
) -> None:
    client.submit("first", id="old", max_tokens=2)
    handles = client.submit_many(
        [{"prompt": "again", "id": "old"}, {"prompt": "y", "id": "fresh"}], idempotent=True
    )
    assert [h.id for h in handles] == ["old", "fresh"]
    assert queued_ids(redis_client) == ["old", "fresh"]
    [(_, first), _] = redis_client.xrange(KEYS.queue("default"))
    assert parse_job(first[JOB_FIELD.encode()]).prompt == "first"  # not replaced


def test_a_retried_call_is_recognised_by_its_tokens(
    client: Client, redis_client: redis.Redis
) -> None:
    """A call whose reply was lost is sent again as is (redis-py's retry): its own jobs
    are found, nothing is queued twice, and no clash is reported."""
    call = client.plan_submit_many(
        [{"prompt": "a", "id": "r1"}, {"prompt": "b"}], None, attach=False
    )
    [plan] = call.parts
    first = client._submit_many(keys=plan.keys, args=plan.args)
    again = client._submit_many(keys=plan.keys, args=plan.args)
    assert client.check_submitted_many(call, [first]) == client.check_submitted_many(call, [again])
    assert queued_ids(redis_client) == plan.job_ids


@pytest.mark.parametrize(
    ("jobs", "field", "words"),
    [
        ([{"prompt": "a", "id": "d"}, {"prompt": "b", "id": "d"}], "id", "twice"),
        ([{"prompt": "a"}, {"prompt": "b", "temperature": -1}], "temperature", "job 1 of the call"),
        ([], "jobs", "no job"),
        ([{"prompt": "a"}] * (MAX_SUBMIT_MANY + 1), "jobs", "in parts"),
    ],
)
def test_bad_calls_are_refused_before_anything_is_sent(
    client: Client, redis_client: redis.Redis, jobs: list[Any], field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        client.submit_many(jobs)
    assert caught.value.field == field and words in str(caught.value)
    assert redis_client.dbsize() == 0


def test_jobs_submitted_together_all_run(redis_server: RedisServer, client: Client) -> None:
    prompts = [f"job {i}" for i in range(6)]
    with text_daemon(redis_server.url):
        handles = client.submit_many([{"prompt": p, "max_tokens": 5} for p in prompts])
        texts = [handle.result(timeout=30).text for handle in handles]
    assert texts == [expected_text(p, 5) for p in prompts]


def test_the_async_client_submits_many(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async def main() -> list[str]:
        async with AsyncClient(redis_server.url, block_ms=200) as client:
            handles = await client.submit_many([{"prompt": "a", "id": "a1"}, {"prompt": "b"}])
            with pytest.raises(ValidationError):
                await client.submit_many([{"prompt": "c", "id": "a1"}])
            return [h.id for h in handles]

    ids = asyncio.run(main())
    assert ids[0] == "a1" and queued_ids(redis_client) == ids


def test_a_refusing_redis_raises_and_queues_no_job(
    client: Client, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    """Over maxmemory the first write is refused, and a user denied the queue stream
    (NOPERM) is refused before the script runs (its keys are declared): either way the
    call raises and nothing is written."""
    redis_client.config_set("maxmemory", 1)
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        client.submit_many([{"prompt": "a", "id": "o1"}, {"prompt": "b", "id": "o2"}])
    redis_client.config_set("maxmemory", 0)
    assert redis_client.dbsize() == 0
    redis_client.acl_setuser(
        "noqueue", enabled=True, passwords=["+pw"], keys=["batchd:job:*"], commands=["+@all"]
    )
    url = redis_server.url.replace("redis://", "redis://noqueue:pw@")
    with Client(url, block_ms=200) as refused, pytest.raises(redis.exceptions.NoPermissionError):
        refused.submit_many([{"prompt": "a", "id": "n1"}, {"prompt": "b", "id": "n2"}])
    assert redis_client.dbsize() == 0


def test_a_queue_entry_refused_mid_script_leaves_no_job_behind(
    client: Client, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    """Refusals that reach the script after it wrote a status hash: the queue key holding
    another type, a user denied XADD itself, the stream out of ids after the call's first
    entry. Redis keeps a failed script's earlier writes, so the scripts undo them: the
    call raises Redis's error, and no hash or entry of it is left (a hash left alone would
    make the job id taken by a job never queued, and a retry take it as queued)."""
    queue = KEYS.queue("default")
    redis_client.set(queue, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.submit(prompt="a", id="w1")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.submit_many([{"prompt": "a", "id": "w1"}, {"prompt": "b", "id": "w2"}])
    assert redis_client.keys("batchd:job:*") == []
    redis_client.delete(queue)
    assert client.submit(prompt="a", id="w1").id == "w1"
    assert queued_ids(redis_client) == ["w1"]

    redis_client.acl_setuser(
        "noxadd", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-xadd"]
    )
    url = redis_server.url.replace("redis://", "redis://noxadd:pw@")
    # redis-server 7.0 words a command denied inside a script without the NOPERM code.
    denied_xadd = "NOPERM|can't run this command"
    with Client(url, block_ms=200) as denied:
        with pytest.raises(redis.ResponseError, match=denied_xadd):
            denied.submit(prompt="a", id="d1")
        with pytest.raises(redis.ResponseError, match=denied_xadd):
            denied.submit_many([{"prompt": "a", "id": "d1"}, {"prompt": "b", "id": "d2"}])
    assert not redis_client.exists(KEYS.job("d1"), KEYS.job("d2"))

    # The next id after this one is the last a stream can hold: the call's first entry
    # goes in, its second is refused, and the first is taken out again.
    last_but_one = f"{2**64 - 1}-{2**64 - 2}"
    redis_client.xadd(KEYS.queue("full"), {"x": "y"}, id=last_but_one)
    with pytest.raises(redis.ResponseError, match="exhausted"):
        client.submit_many([{"prompt": "a", "id": "e1"}, {"prompt": "b", "id": "e2"}], queue="full")
    assert [entry_id for entry_id, _ in redis_client.xrange(KEYS.queue("full"))] == [
        last_but_one.encode()
    ]
    assert not redis_client.exists(KEYS.job("e1"), KEYS.job("e2"))
