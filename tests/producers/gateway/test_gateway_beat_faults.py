"""The gateway's heartbeat while Redis refuses its writes (out of memory, noeviction).

Redis answers the heartbeat's SET, and the submit's XADD, with an OOM error reply: the
gateway goes on answering (503 only for the submit Redis refused), warns of the lost beat
once rather than every second, and beats again, and serves, once Redis takes writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from support.daemon_harness import wait_until

ALIVE = "batchd:gateway:alive:*"
# Over two of the gateway's beats (one a second): a warning per beat would show.
REFUSED_S = 2.5


def _alive(client: redis.Redis) -> dict[str, Any]:
    keys = list(client.scan_iter(ALIVE))
    assert len(keys) <= 1, keys
    raw: Any = client.get(keys[0]) if keys else None
    return orjson.loads(raw) if raw else {}


def _ask(oai: openai.OpenAI) -> str:
    reply = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    return reply.choices[0].finish_reason


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.config_set("maxmemory-policy", "noeviction")
    yield client
    client.config_set("maxmemory", 0)
    client.close()


def test_an_oom_refusal_costs_the_beat_not_the_gateway(
    gateway: Any, oai: openai.OpenAI, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert _ask(oai) == "length"
    wait_until(lambda: bool(_alive(admin)), what="the gateway's heartbeat")
    key = next(admin.scan_iter(ALIVE)).decode()

    caplog.set_level(logging.INFO)
    admin.config_set("maxmemory", 1)
    refused_at = time.time()
    with pytest.raises(openai.APIStatusError) as refused:
        _ask(oai)  # Redis refuses the XADD
    assert refused.value.status_code == 503
    # Said as a refusal, not as "unreachable"; Redis's own text (an ACL names users) not.
    assert "out of memory" in refused.value.message, refused.value.message
    assert "OOM command" not in refused.value.message
    assert httpx.get(f"{gateway.url}/health/live", timeout=5).status_code == 200
    assert oai.models.list().data  # reads still answer
    time.sleep(REFUSED_S)
    assert _alive(admin).get("at", 0) < refused_at, "a beat was set while Redis refused it"
    lost = [r for r in caplog.records if key in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(lost) == 1, [r.getMessage() for r in lost]
    assert "OutOfMemoryError" in lost[0].getMessage()

    admin.config_set("maxmemory", 0)
    wait_until(lambda: _alive(admin).get("at", 0) > refused_at, timeout=5, what="a new beat")

    # The beat's thread says so just after its SET returns, which this test may see first.
    def restored() -> bool:
        return any("restored" in r.getMessage() for r in caplog.records if key in r.getMessage())

    wait_until(restored, timeout=5, what="the heartbeat's restored line")
    ready = lambda: httpx.get(f"{gateway.url}/health/ready", timeout=5).status_code == 200  # noqa: E731
    wait_until(ready, timeout=5, what="the gateway ready")
    assert _ask(oai) == "length"
