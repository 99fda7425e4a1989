"""What the gateway takes from the fleet's heartbeats and tells of itself, on a real
daemon, gateway and redis-server: the model's context bound refuses what cannot fit
(OpenAI's ``context_length_exceeded``), the prefix cache shows in
``usage.prompt_tokens_details.cached_tokens``, and the gateway keeps a heartbeat of its
own while it runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from batchd import __version__
from batchd.engine.config import EngineConfig
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.keys import Keys

MODEL = "tiny"
KEYS = Keys()
# The tiny fixture's max_position_embeddings (no max_model_len set by the test daemon).
CONTEXT = 2048


def _refusal(exc: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    body: Any = exc.value.body
    return dict(body) if isinstance(body, dict) else {}


def test_a_request_longer_than_the_context_is_refused_as_openai_does(
    oai: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=CONTEXT
        )
    assert chat.value.status_code == 400
    error = _refusal(chat)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]

    ids = [7] * (CONTEXT - 40)
    with pytest.raises(openai.BadRequestError) as text:
        oai.completions.create(model=MODEL, prompt=ids, max_tokens=41)
    error = _refusal(text)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"requested {CONTEXT + 1} tokens ({CONTEXT - 40} in the prompt, 41" in error["message"]
    fits = oai.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)
    assert fits.usage is not None and fits.usage.prompt_tokens == CONTEXT - 40


def test_the_second_of_two_jobs_with_one_long_prompt_reports_its_cached_tokens(
    oai: openai.OpenAI,
) -> None:
    rng = random.Random(47)
    prompt = [rng.randrange(3, 1000) for _ in range(75)]
    block = EngineConfig().block_size
    shared = (len(prompt) - 1) // block * block  # full blocks before the last token
    cached = []
    for _ in range(2):
        reply = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert shared > 0 and cached == [0, shared]


def _gateways(conn: redis.Redis) -> list[dict[str, Any]]:
    """The gateway heartbeats in Redis now."""
    found = list(conn.scan_iter(match=KEYS.gateway("*")))
    return [orjson.loads(v) for v in conn.mget(found) if v is not None] if found else []


def test_a_gateway_beats_while_it_runs(
    redis_url: str, daemon: Any, tmp_path: Path, start_gateway: Any
) -> None:
    conn = redis.Redis.from_url(redis_url)
    before = {b["name"] for b in _gateways(conn)}
    options = GatewayOptions(files_dir=tmp_path, queue="default")
    with start_gateway(redis_url, options):
        mine = [b for b in _gateways(conn) if b["name"] not in before]
        assert len(mine) == 1
        beat = mine[0]
        assert beat["version"] == __version__ and beat["queue"] == "default"
        key = KEYS.gateway(beat["name"])
        assert 0 < int(conn.pttl(key)) <= 15_000  # a TTL: a killed gateway's key expires
        assert orjson.loads(conn.get(key) or b"{}")["pid"] == beat["pid"]
    assert not conn.exists(key)  # a stopped gateway's key goes with it
