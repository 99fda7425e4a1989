"""The proving ground's own parts: the AOF cut really loses the last second on a real
redis-server, hostile entries are all invalid, and the verdict counts what it claims."""

from __future__ import annotations

import time
from pathlib import Path

import fakeredis

from batchd.daemon.chaos.aof import AofTail
from batchd.daemon.chaos.hostile import HostileSource
from batchd.daemon.chaos.ledger import HostileSend, Ledger
from batchd.daemon.chaos.verdict import judge
from batchd.daemon.chaos.workload import ChaosJob, Via
from batchd.daemon.redis_server import RedisServer
from batchd.producers.errors import ValidationError
from batchd.producers.keys import EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.schema import Event, FinishReason, parse_job

KEYS = Keys()


def test_a_cut_loses_what_was_written_in_the_last_second_only(tmp_path: Path) -> None:
    server = RedisServer(
        tmp_path / "redis",
        appendonly=True,
        extra_args=["--appendfsync", "everysec", "--aof-load-truncated", "yes"],
    ).start()
    tail = AofTail(server.directory, window_s=0.5).start()
    try:
        client = server.client()
        client.set("early", 1)
        time.sleep(1.0)  # sampled well before the cut's window
        client.set("late", 1)
        time.sleep(0.1)
        server.kill()
        cut = tail.cut()
        server.start()
        client = server.client()
        assert cut.dropped_bytes > 0
        assert client.exists("early") and not client.exists("late")
    finally:
        tail.join()
        server.kill()


def test_every_hostile_entry_is_invalid() -> None:
    source = HostileSource(seed=3)
    for _ in range(300):
        entry = source.entry(["chaos-0-1", "chaos-0-2"])
        if JOB_FIELD in entry:
            try:
                parse_job(entry[JOB_FIELD])
            except ValidationError:
                continue
            raise AssertionError(f"a valid job among the hostile entries: {entry}")


def _job(job_id: str, *, seed: int | None = None) -> ChaosJob:
    payload = {"id": job_id, "prompt_token_ids": [1, 2], "max_tokens": 3}
    if seed is not None:
        payload.update(temperature=0.5, seed=seed)
    return ChaosJob(payload=payload, via=Via.client, duplicate=False, cancel=None)


def _events(tokens: list[int], reason: FinishReason) -> list[Event]:
    events = [Event(seq=i, token_id=t) for i, t in enumerate(tokens)]
    return [*events, Event(seq=len(tokens), finish_reason=reason)]


def test_the_verdict_counts_each_kind_of_failure() -> None:
    client = fakeredis.FakeRedis()
    jobs = [_job("ok"), _job("lost"), _job("wrong", seed=1), _job("gap"), _job("twice")]
    reference = {job.id: [5, 6, 7] for job in jobs}
    ledger = Ledger()
    for event in _events([5, 6, 7], FinishReason.length):
        ledger.deliver("ok", event)
        ledger.deliver("twice", event)
    ledger.deliver("lost", Event(seq=0, token_id=5))
    for event in _events([5, 6, 8], FinishReason.length):
        ledger.deliver("wrong", event)
    for event in _events([5, 6, 7], FinishReason.length)[1:]:
        ledger.deliver("gap", event)
    # What Redis holds for "twice" is another run's: other tokens than its client got.
    for seq, event in enumerate(_events([5, 6, 9], FinishReason.length)):
        client.xadd(KEYS.events("twice"), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    entry = client.xadd(KEYS.queue(), {JOB_FIELD: b"{"}).decode()
    ledger.hostile.append(HostileSend(entry, 0.0, {JOB_FIELD: b"{"}))
    verdict = judge(jobs, reference, ledger, client, Keys(), unexpected_exits=0)
    assert verdict.completed == 2  # "ok", and "twice" as its client saw it
    assert (verdict.lost, verdict.differing_seeded, verdict.differing_greedy) == (1, 1, 1)
    assert (verdict.broken_streams, verdict.completed_twice) == (1, 1)
    assert verdict.hostile_sent - verdict.hostile_dead_lettered == 1  # never dead-lettered
    assert not verdict.passed


def test_the_verdict_judges_what_a_subscriber_read_as_one_run() -> None:
    """An unseeded sampled job is held to the reference like a seeded one, and a job
    that did not complete fails if what its subscriber read mixes two runs (a resumed
    run that drew new samples after a lost tail)."""
    client = fakeredis.FakeRedis()
    unseeded = {"id": "u", "prompt_token_ids": [1, 2], "max_tokens": 3, "temperature": 1.0}
    jobs = [
        ChaosJob(payload=unseeded, via=Via.xadd, duplicate=False, cancel=None),
        _job("mixed"),
        _job("prefix"),
    ]
    reference = {job.id: [5, 6, 7] for job in jobs}
    ledger = Ledger()
    for event in _events([5, 9, 7], FinishReason.length):
        ledger.deliver("u", event)
    for event in [Event(seq=0, token_id=5), Event(seq=1, token_id=8)]:
        ledger.deliver("mixed", event)
    for event in [Event(seq=0, token_id=5), Event(seq=1, finish_reason=FinishReason.error)]:
        ledger.deliver("prefix", event)
    verdict = judge(jobs, reference, ledger, client, Keys(), unexpected_exits=0)
    assert verdict.differing_unseeded == 1
    assert verdict.mixed_runs == 1 and verdict.lost == 1
    assert verdict.zeros()["streams a subscriber read mixing two runs"] == 1
    assert not verdict.passed


def test_the_verdict_counts_a_stored_end_other_than_the_one_read() -> None:
    """The subscriber read the job complete; Redis lost that end and now holds the same
    tokens ended as failed (a lost end that was ended instead of run again)."""
    client = fakeredis.FakeRedis()
    jobs = [_job("relapsed")]
    ledger = Ledger()
    for event in _events([5, 6, 7], FinishReason.length):
        ledger.deliver("relapsed", event)
    for seq, event in enumerate(_events([5, 6, 7], FinishReason.error)):
        client.xadd(KEYS.events("relapsed"), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    verdict = judge(jobs, {"relapsed": [5, 6, 7]}, ledger, client, Keys(), unexpected_exits=0)
    assert verdict.completed == 1 and verdict.completed_twice == 0
    assert verdict.zeros()["stored ends differing from the end a subscriber read"] == 1
    assert not verdict.passed


def test_a_hostile_entry_lost_with_redis_may_still_be_dead_lettered_once() -> None:
    """A daemon that read an entry before Redis lost it dead-letters it from memory: that
    letter is expected (once), next to the letter of the entry sent again."""
    client = fakeredis.FakeRedis()
    ledger = Ledger()
    ledger.hostile_lost.add("1-0")
    client.xadd(KEYS.dead, {"entry": "1-0", "error": "bad"})
    assert judge([], {}, ledger, client, Keys(), unexpected_exits=0).unexpected_dead_letters == 0
    client.xadd(KEYS.dead, {"entry": "1-0", "error": "bad"})
    client.xadd(KEYS.dead, {"entry": "9-9", "error": "bad"})
    assert judge([], {}, ledger, client, Keys(), unexpected_exits=0).unexpected_dead_letters == 2
