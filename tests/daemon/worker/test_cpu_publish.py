"""A daemon whose engine computes on the CPU waits for each publish round trip between
steps instead of running it beside the next step (batchd.daemon.worker.cadence: there
the engine's threads take every core). Real engine (tiny model), real redis-server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from batchd.engine import EngineConfig
from batchd.producers.client import Client
from support.daemon_harness import ENGINE_OPTS, fast_settings, worker_thread
from support.redis_server import RedisServer


def test_an_engine_on_the_cpu_settles_each_pipeline_before_its_next_step(
    redis_server: RedisServer, tiny_model: Path
) -> None:
    from batchd.daemon.worker.mlx_generator import MLXGenerator

    def make() -> MLXGenerator:
        return MLXGenerator.from_pretrained(str(tiny_model), EngineConfig(**ENGINE_OPTS))

    on_cpu = mx.default_device() == mx.cpu
    overlapped: list[bool] = []
    with worker_thread(fast_settings(redis_server.url), make) as worker:
        assert worker.gen.steps_use_cpu is on_cpu
        step = worker.gen.step

        def long_step() -> Any:
            overlapped.append(worker.cadence.in_flight)
            time.sleep(0.015)  # long enough to be overlapped off the CPU
            return step()

        worker.gen.step = long_step  # type: ignore[method-assign]
        with Client(redis_server.url) as client:
            job = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=24, ignore_eos=True)
            result = job.result(timeout=60)
    assert result.usage.completion_tokens == 24
    assert len(overlapped) >= 24, overlapped
    if on_cpu:
        assert not any(overlapped), overlapped
    else:
        assert sum(overlapped) >= len(overlapped) - 3, overlapped
