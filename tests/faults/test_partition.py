"""Scenario 4: a partition longer than the heartbeat TTL. Daemon A is cut off, B
claims A's jobs and carries on; when the network heals, A's delayed writes are
fenced off (a later pickup owns the job), A drops the jobs without writing, and
each job ends once with A's stored tokens followed by B's, never interleaved.

B samples differently from A here (as unseeded sampling may after a takeover), so
a stream that mixed the two owners' tokens would show it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from batchd.daemon.chaos.proxy import proxy_to
from batchd.engine.outputs import RequestOutput
from faults.checks import KEYS, fake_jobs, wait_nothing_pending
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    expected_fake_tokens,
    fast_settings,
    status_of,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer

SHIFT = 1000


@dataclass
class OtherSampler(FakeGenerator):
    """B: other tokens than A's, and a slow first step, so that A's delayed step lands
    after B read the jobs' events and before B writes."""

    first_delay_s: float = 0.5

    def step(self) -> list[RequestOutput]:
        time.sleep(self.first_delay_s)
        self.first_delay_s = 0.0
        return [dataclasses.replace(out, token_id=out.token_id + SHIFT) for out in super().step()]


def test_partitioned_daemon_never_mixes_its_tokens_with_the_new_owner(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    jobs = fake_jobs(2, prefix="part", max_tokens=80)
    with proxy_to(redis_server.port) as proxy:
        a_settings = fast_settings(proxy.url, block_ms=100)
        slow = lambda: FakeGenerator(max_running=4, step_delay_s=0.02)  # noqa: E731
        with worker_thread(a_settings, slow, consumer="a") as a:
            for job in jobs:
                enqueue(client, KEYS, job)
            wait_until(lambda: len(a.held) == 2, what="A holds both jobs")
            wait_until(lambda: client.xlen(KEYS.events("part0")) >= 5, what="A's tokens")
            proxy.pause()
            b_settings = fast_settings(redis_server.url)
            with worker_thread(b_settings, OtherSampler, consumer="b") as b:
                wait_until(lambda: len(b.held) == 2, timeout=20, what="B claims both jobs")
                proxy.resume()  # A's delayed step reaches Redis now
                wait_until(lambda: not a.held, timeout=20, what="A drops the jobs")
                done = wait_final(client, KEYS, [job["id"] for job in jobs], timeout=30)
    for job in jobs:
        events = done[job["id"]]  # gap-free and duplicate-free from seq 0
        assert sum(e.final for e in events) == 1
        ours = expected_fake_tokens(job["prompt_token_ids"], job.get("seed"), job["max_tokens"])
        tokens = token_ids(events)
        cut = next(i for i, t in enumerate(tokens) if t >= SHIFT)
        assert tokens[:cut] == ours[:cut], "A's tokens, in order"
        assert tokens[cut:] == [t + SHIFT for t in ours[cut:]], "then only B's"
        assert status_of(client, KEYS, job["id"]).daemon == "b"
    wait_nothing_pending(client)
