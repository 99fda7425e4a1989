"""The worker loop against a real redis-server and a deterministic fake engine.

Fast: no model. Each test checks one promise of the daemon: exactly-once
seq, pickup decisions (duplicate, cancelled, expired, poison, already
finished), resume from the events checkpoint, cancellation within a step,
backpressure, and never taking a live daemon's job.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
import redis

from batchd.daemon.ops.observer import Ops
from batchd.daemon.worker.cadence import OVERLAP_MIN_STEP_S
from batchd.daemon.worker.publisher import Flush
from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.schema import Event, FinishReason, JobState
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    events_of,
    expected_fake_tokens,
    fast_settings,
    status_of,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()


def _prompt_ids(text: str) -> list[int]:
    return [ord(c) % 256 for c in text]


def test_jobs_complete_with_every_seq_once(redis_server: RedisServer) -> None:
    client = redis_server.client()
    settings = fast_settings(redis_server.url)
    jobs = {f"j{i}": (f"prompt {i}" * (i + 1), 3 + i, i) for i in range(12)}
    with worker_thread(settings, lambda: FakeGenerator(max_running=4)):
        for job_id, (prompt, max_tokens, seed) in jobs.items():
            enqueue(
                client,
                KEYS,
                {"id": job_id, "prompt": prompt, "max_tokens": max_tokens, "seed": seed},
            )
        done = wait_final(client, KEYS, list(jobs), timeout=20)
        wait_until(lambda: client.xlen(KEYS.queue()) == 0, what="acked entries trimmed")
        heartbeat = orjson.loads(client.get(KEYS.daemon("test-worker")) or b"{}")
    assert {"model", "queues", "running", "waiting", "kv_usage", "tokens_per_s"} <= set(heartbeat)
    assert {"pid", "host", "started_at"} <= set(heartbeat)
    assert client.get(KEYS.daemon("test-worker")) is None  # removed on a clean stop
    for job_id, (prompt, max_tokens, seed) in jobs.items():
        events = done[job_id]
        assert token_ids(events) == expected_fake_tokens(_prompt_ids(prompt), seed, max_tokens)
        final = events[-1]
        assert final.finish_reason is FinishReason.length
        assert final.text == "".join(e.text for e in events[:-1])
        assert final.usage is not None and final.usage.completion_tokens == max_tokens
        status = status_of(client, KEYS, job_id)
        assert status.state is JobState.finished
        assert status.completion_tokens == max_tokens
        assert client.ttl(KEYS.events(job_id)) > 0 and client.ttl(KEYS.job(job_id)) > 0
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0


def test_backpressure_reads_only_what_the_engine_can_admit(redis_server: RedisServer) -> None:
    client = redis_server.client()
    settings = fast_settings(redis_server.url, intake_buffer=1)
    settings.engine.max_num_seqs = 2
    ids = [f"bp{i}" for i in range(10)]
    # The group exists before the first XPENDING, however slowly the worker starts.
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    with worker_thread(settings, lambda: FakeGenerator(max_running=2, step_delay_s=0.01)):
        for job_id in ids:
            enqueue(client, KEYS, {"id": job_id, "prompt": "x", "max_tokens": 5})
        most = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pending: Any = client.xpending(KEYS.queue(), CONSUMER_GROUP)
            most = max(most, pending["pending"])
            if all(client.hget(KEYS.job(j), "state") == b"finished" for j in ids):
                break
            time.sleep(0.005)
    assert 0 < most <= 3  # max_num_seqs + intake_buffer
    wait_final(client, KEYS, ids, timeout=10)


def test_cancel_takes_effect_within_a_step(redis_server: RedisServer) -> None:
    client = redis_server.client()
    gen = FakeGenerator(step_delay_s=0.01)
    with worker_thread(fast_settings(redis_server.url), lambda: gen), Client(redis_server.url) as c:
        job = c.submit("long one", id="c1", max_tokens=4000)
        wait_until(lambda: client.xlen(KEYS.events("c1")) >= 3, what="first tokens")
        assert job.cancel()
        events = wait_final(client, KEYS, ["c1"], timeout=10)["c1"]
    assert events[-1].finish_reason is FinishReason.cancelled
    assert len(events) < 100
    assert gen.aborted == ["c1"]
    assert status_of(client, KEYS, "c1").state is JobState.cancelled


def test_pickup_refuses_cancelled_expired_and_duplicate_jobs(redis_server: RedisServer) -> None:
    client = redis_server.client()
    gen = FakeGenerator()
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    # Cancelled before any daemon saw it.
    client.hset(KEYS.job("cx"), mapping={"state": "queued", "cancel_requested": "1"})
    enqueue(client, KEYS, {"id": "cx", "prompt": "x", "max_tokens": 5})
    # Enqueued 10 s ago with a 1 s ttl (the entry id carries the enqueue time).
    old = f"{int(time.time() * 1000) - 10_000}-0"
    client.xadd(
        KEYS.queue("old"),
        {JOB_FIELD: orjson.dumps({"id": "ex", "prompt": "x", "ttl_s": 1})},
        id=old,
    )
    # The same id twice: runs once.
    enqueue(client, KEYS, {"id": "dup", "prompt": "x", "max_tokens": 4})
    enqueue(client, KEYS, {"id": "dup", "prompt": "x", "max_tokens": 4})
    settings = fast_settings(redis_server.url)
    settings.queues = ["default", "old"]
    with worker_thread(settings, lambda: gen):
        done = wait_final(client, KEYS, ["cx", "ex", "dup"], timeout=10)
        wait_until(
            lambda: client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0, what="acks"
        )
    assert [e.finish_reason for e in done["cx"]] == [FinishReason.cancelled]
    assert [e.finish_reason for e in done["ex"]] == [FinishReason.expired]
    assert status_of(client, KEYS, "ex").state is JobState.expired
    assert len(token_ids(done["dup"])) == 4
    assert "cx" not in gen.started and "ex" not in gen.started
    assert gen.started.count("dup") == 1


def _pending_for_dead_consumer(client: redis.Redis, job: dict[str, Any], *, reads: int = 1) -> str:
    """Enqueue ``job`` and leave it pending for consumer "dead" (no heartbeat)."""
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = enqueue(client, KEYS, job)
    client.xreadgroup(CONSUMER_GROUP, "dead", {KEYS.queue(): ">"})
    for _ in range(reads - 1):
        client.xreadgroup(CONSUMER_GROUP, "dead", {KEYS.queue(): "0"})
    return entry


def _store(client: redis.Redis, job_id: str, events: list[Event]) -> None:
    for event in events:
        client.xadd(KEYS.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(event.seq))


def test_dead_consumers_job_resumes_at_the_next_seq(redis_server: RedisServer) -> None:
    client = redis_server.client()
    _pending_for_dead_consumer(
        client, {"id": "r1", "prompt": "resume me", "max_tokens": 9, "seed": 5}
    )
    expected = expected_fake_tokens(_prompt_ids("resume me"), 5, 9)
    _store(
        client, "r1", [Event(seq=i, token_id=t, text=f"{t} ") for i, t in enumerate(expected[:4])]
    )
    client.hset(KEYS.job("r1"), mapping={"state": "running", "daemon": "dead", "started_at": "1.0"})
    with worker_thread(fast_settings(redis_server.url), FakeGenerator):
        events = wait_final(client, KEYS, ["r1"], timeout=10)["r1"]
    assert token_ids(events) == expected
    assert events[-1].text == "".join(f"{t} " for t in expected)
    status = status_of(client, KEYS, "r1")
    assert status.state is JobState.finished and status.daemon == "test-worker"
    assert status.started_at == 1.0


def test_final_event_without_ack_is_only_repaired(redis_server: RedisServer) -> None:
    client = redis_server.client()
    _pending_for_dead_consumer(client, {"id": "f1", "prompt": "x", "max_tokens": 2})
    final = Event(seq=2, text="a b", finish_reason=FinishReason.length)
    _store(
        client,
        "f1",
        [Event(seq=0, token_id=1, text="a"), Event(seq=1, token_id=2, text=" b"), final],
    )
    client.hset(KEYS.job("f1"), mapping={"state": "running"})
    gen = FakeGenerator()
    with worker_thread(fast_settings(redis_server.url), lambda: gen):
        wait_until(lambda: client.hget(KEYS.job("f1"), "state") == b"finished", what="repair")
        wait_until(
            lambda: client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0, what="ack"
        )
    assert len(events_of(client, KEYS, "f1")) == 3
    assert gen.started == []


def test_a_job_delivered_many_times_runs_alone_and_completes(redis_server: RedisServer) -> None:
    """Deliveries alone never make a job poison (a daemon killed mid-batch takes every
    job of the batch with it): a job delivered 4 times runs by itself and completes."""
    client = redis_server.client()
    _pending_for_dead_consumer(client, {"id": "p1", "prompt": "x", "max_tokens": 2}, reads=3)
    with worker_thread(fast_settings(redis_server.url, max_deliveries=3), FakeGenerator):
        events = wait_final(client, KEYS, ["p1"], timeout=10)["p1"]
    assert events[-1].finish_reason is FinishReason.length
    assert client.hget(KEYS.job("p1"), "alone_delivery") == b"4"
    assert client.xlen(KEYS.dead) == 0


def test_poison_job_is_dead_lettered(redis_server: RedisServer) -> None:
    """Its status says an earlier delivery started it alone and no event came after: the
    daemon died while running it alone. The second such crash dead-letters it."""
    client = redis_server.client()
    _pending_for_dead_consumer(client, {"id": "p1", "prompt": "x", "max_tokens": 2}, reads=3)
    client.hset(
        KEYS.job("p1"),
        mapping={"alone_delivery": "3", "alone_from": "0", "alone_crashes": "1"},
    )
    with worker_thread(fast_settings(redis_server.url, max_deliveries=3), FakeGenerator):
        events = wait_final(client, KEYS, ["p1"], timeout=10)["p1"]
    assert events[-1].finish_reason is FinishReason.error
    error = events[-1].error or ""
    assert "poison: the daemon died 2 times while running this job alone" in error
    dead: Any = client.xrange(KEYS.dead)
    assert [fields[b"id"] for _, fields in dead] == [b"p1"]


def test_live_daemons_long_job_is_never_claimed(redis_server: RedisServer) -> None:
    client = redis_server.client()
    # A TTL of ten heartbeat intervals: a loaded host may delay a beat, but a live
    # daemon's key must not lapse for that (which would be a dead daemon, rightly claimed).
    ttl_s = 1.0
    settings = fast_settings(redis_server.url, heartbeat_ttl_s=ttl_s, claim_interval_s=0.05)
    slow = FakeGenerator(step_delay_s=0.01)
    with worker_thread(settings, lambda: slow, consumer="a"):
        enqueue(client, KEYS, {"id": "long", "prompt": "x", "max_tokens": 400})
        wait_until(lambda: client.xlen(KEYS.events("long")) >= 1, what="a starts the job")
        with worker_thread(settings, FakeGenerator, consumer="b") as b:
            watched_from = time.monotonic()
            # 400 steps of 10 ms at least: many heartbeat TTLs and claim passes by b, the
            # entry idle all along.
            events = wait_final(client, KEYS, ["long"], timeout=60)["long"]
            watched_s = time.monotonic() - watched_from
            assert not b.held
    assert len(token_ids(events)) == 400
    assert status_of(client, KEYS, "long").daemon == "a"
    # The claim rule had its chance: b watched the job for several TTLs (longer when slow).
    assert watched_s > 3 * ttl_s, watched_s


def test_a_busy_step_costs_one_round_trip(redis_server: RedisServer) -> None:
    """Intake and cancellations ride the publish pipeline: no read of their own per step."""
    client = redis_server.client()
    # Round trips are counted from the first step to the last: an idle daemon's blocked
    # reads (one per block_ms) before and after add with time, which a loaded host stretches.
    counts = {"round_trips": 0, "steps": 0, "at_first_step": 0, "at_last_step": 0}
    ids = [f"rt{i}" for i in range(4)]
    with worker_thread(
        fast_settings(redis_server.url, claim_interval_s=60.0),
        lambda: FakeGenerator(max_running=4, step_delay_s=0.002),
    ) as worker:
        pool = worker.redis.connection_pool
        get_connection = pool.get_connection

        def counting_connection(*args: Any, **kwargs: Any) -> Any:
            conn = get_connection(*args, **kwargs)
            if not getattr(conn, "counted", False):
                send = conn.send_packed_command

                def counted_send(*a: Any, **k: Any) -> Any:
                    counts["round_trips"] += 1
                    return send(*a, **k)

                conn.send_packed_command = counted_send  # type: ignore[method-assign]
                conn.counted = True  # type: ignore[attr-defined]
            return conn

        step = worker.gen.step

        def counted_step() -> Any:
            counts["steps"] += 1
            if counts["steps"] == 1:
                counts["at_first_step"] = counts["round_trips"]
            counts["at_last_step"] = counts["round_trips"]
            return step()

        pool.get_connection = counting_connection  # type: ignore[method-assign]
        worker.gen.step = counted_step  # type: ignore[method-assign]
        for job_id in ids:
            enqueue(client, KEYS, {"id": job_id, "prompt": "x", "max_tokens": 60})
        wait_final(client, KEYS, ids, timeout=20)
    # One pipeline per step; pickups and acks add a handful, not one per step.
    assert counts["steps"] >= 60
    busy_round_trips = counts["at_last_step"] - counts["at_first_step"]
    assert 0 < busy_round_trips <= counts["steps"] + 25, counts


@pytest.mark.parametrize(("step_s", "on_cpu"), [(0.02, False), (0.002, False), (0.02, True)])
def test_a_long_step_runs_while_the_last_steps_pipeline_is_in_flight(
    redis_server: RedisServer, step_s: float, on_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish round trip overlaps the next step when steps are long enough to hide
    it (not the short ones: see OVERLAP_MIN_STEP_S) and the engine leaves the CPU free
    (not one computing on it: Generator.steps_use_cpu), and every token still arrives
    once, in order. Either way each publish reports the engine thread's time on it."""
    client = redis_server.client()
    overlapped: list[bool] = []
    published: list[float] = []
    executed: list[bool] = []
    execute = Flush.execute

    def counted_execute(flush: Flush) -> list[Any]:
        executed.append(True)
        return execute(flush)

    monkeypatch.setattr(Flush, "execute", counted_execute)
    monkeypatch.setattr(Ops, "published", lambda _, seconds: published.append(seconds))
    ids = [f"ov{i}" for i in range(3)]
    # Before each step: the last step's time as the worker measured it (which decided
    # whether its publish overlaps this step), and whether that publish is in flight.
    observed: list[tuple[float, bool]] = []
    with worker_thread(
        fast_settings(redis_server.url),
        lambda: FakeGenerator(step_delay_s=step_s, steps_use_cpu=on_cpu),
    ) as worker:
        step = worker.gen.step

        def observed_step() -> Any:
            overlapped.append(worker.cadence.in_flight)
            observed.append((worker.last_step_s, worker.cadence.in_flight))
            return step()

        worker.gen.step = observed_step  # type: ignore[method-assign]
        for job_id in ids:
            enqueue(client, KEYS, {"id": job_id, "prompt": job_id, "max_tokens": 40})
        events = wait_final(client, KEYS, ids, timeout=20)
    assert len(overlapped) >= 40, overlapped
    if step_s >= OVERLAP_MIN_STEP_S and not on_cpu:
        assert sum(overlapped) >= len(overlapped) - 3, overlapped
    elif on_cpu:
        assert not any(overlapped), overlapped
    else:
        # Short steps: on a loaded host a 2 ms step may be measured over the threshold,
        # and its publish then rightly overlaps the next; one measured short never does.
        short = [flying for last_s, flying in observed if last_s < OVERLAP_MIN_STEP_S]
        assert len(short) >= 5, observed
        assert not any(short), observed
    for job_id in ids:
        assert token_ids(events[job_id]) == expected_fake_tokens(_prompt_ids(job_id), None, 40)
    # Every pipeline of the loop is reported once; leaving flushes up to two more itself.
    assert len(executed) - 2 <= len(published) <= len(executed), (published, len(executed))
    assert all(0 < seconds < 5 for seconds in published), published
