"""``batchd serve --model FILE.gguf``: converted once into the model cache, then served.

The packaged SmolLM2 GGUF through a real daemon subprocess and Redis: a chat
job comes back answered, which only a correct conversion can do.
"""

from __future__ import annotations

from pathlib import Path

from batchd.engine.models.registry import gguf_cache_dir, packaged_gguf
from batchd.producers.client import Client
from support.daemon_harness import DaemonProcess, daemon_config
from support.redis_server import RedisServer


def test_serve_converts_a_gguf_once_and_answers(tmp_path: Path, redis_server: RedisServer) -> None:
    gguf = packaged_gguf("smollm2")
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(config, model=gguf, log_path=tmp_path / "d.log")
    daemon.wait_serving(timeout=120)
    try:
        # The daemon's cache is the user's (reused by later runs), whatever its directory.
        assert (gguf_cache_dir(gguf) / "config.json").is_file()
        with Client(redis_server.url) as client:
            question = [{"role": "user", "content": "What is the capital of France?"}]
            job = client.submit(messages=question, max_tokens=16, temperature=0.0)
            result = job.result(timeout=120)
        assert "Paris" in result.text, result.text
        assert result.finish_reason.value == "stop"
    finally:
        daemon.kill()
