"""Redis acknowledged a job's end and lost it: AOF ``appendfsync everysec`` on a real
redis-server, killed right after the jobs finished and cut back to the AOF's size a
second earlier (the chaos AOF cut: what a host crash does to ``everysec``). The final
events and statuses are gone, the tokens before them are not, and the daemon had acked
and forgotten the jobs. Its durability watch reads each ended job's status once the
fsync windows have passed, finds them ``running`` and picks them up again: each ends
once more, with the uninterrupted run's tokens, and every key gets its TTL."""

from __future__ import annotations

from pathlib import Path

from batchd.daemon.chaos.aof import AofTail
from batchd.daemon.redis_server import RedisServer
from faults.checks import KEYS, assert_all_done_once, fake_jobs
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    fast_settings,
    wait_until,
    worker_thread,
)


def test_an_end_redis_lost_after_the_ack_is_found_and_run_again(tmp_path: Path) -> None:
    server = RedisServer(
        tmp_path / "redis",
        appendonly=True,
        extra_args=["--appendfsync", "everysec", "--aof-load-truncated", "yes"],
    ).start()
    tail = AofTail(server.directory, window_s=0.6).start()
    try:
        client = server.client()
        jobs = fake_jobs(6, prefix="end", max_tokens=60)
        for job in jobs:
            job["max_tokens"] = 60  # all end together, in the last fraction of a second
        settings = fast_settings(server.url)
        with worker_thread(settings, lambda: FakeGenerator(max_running=6, step_delay_s=0.03)):
            for job in jobs:
                enqueue(client, KEYS, job)

            def all_ended() -> bool:
                states = [client.hget(KEYS.job(job["id"]), "state") for job in jobs]
                return all(state == b"finished" for state in states)

            wait_until(all_ended, timeout=30, what="every job ended")
            server.kill()
            cut = tail.cut()
            server.start()
            client = server.client()
            assert cut.dropped_bytes > 0
            states = [client.hget(KEYS.job(job["id"]), "state") for job in jobs]
            # The scenario: some job's tokens were kept and its end was not.
            assert b"running" in states, states
            assert_all_done_once(client, jobs, timeout=30)
            for job in jobs:
                for key in (KEYS.job(job["id"]), KEYS.events(job["id"])):
                    assert client.ttl(key) > 0, key
    finally:
        tail.join()
        server.kill()
