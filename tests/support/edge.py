"""What the edge tests share: a gateway on a thread, its clients, batch files.

The fixtures (tests/security/conftest.py) start one redis-server, the real daemon over
predictable text and gateways per module; rq workers run in the test's own thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import redis
import uvicorn
from starlette.applications import Starlette

from batchd.producers.bulk_worker import bulk_worker
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from support.asgi import serve_in_thread
from support.redis_server import free_port

KEY_A = "sk-alice-0f3c2b9e7d"
KEY_B = "sk-bob-5a1e8c4d20"
MODEL = "text-model"


@dataclass
class Edge:
    """A running gateway and what a test needs to talk to it."""

    url: str
    redis_url: str
    options: GatewayOptions

    @property
    def files_dir(self) -> Path:
        return Path(self.options.files_dir)

    def oai(self, key: str = "none") -> openai.OpenAI:
        """The official client (no retries: a refusal must show)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def work(self) -> bool:
        """One burst of the bulk worker (in-process, this thread: rq wants the main one)."""
        conn = redis.Redis.from_url(self.redis_url)
        try:
            return bulk_worker(conn, files_dir=self.files_dir, burst=True, fork=False)
        finally:
            conn.close()


@contextmanager
def serve(app: Starlette) -> Iterator[str]:
    """``app`` in uvicorn on a thread and a free port of 127.0.0.1; its URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    with serve_in_thread(config) as url:
        yield url


@contextmanager
def edge(redis_url: str, options: GatewayOptions) -> Iterator[Edge]:
    with serve(create_app(redis_url, options)) as url:
        yield Edge(url, redis_url, options)


def jsonl(lines: list[Any]) -> bytes:
    """A batch file: each item a JSON line (bytes are written as they are)."""
    return b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    request = {"model": MODEL, "messages": [{"role": "user", "content": content}], **body}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": request,
    }


def start_batch(client: openai.OpenAI, data: bytes, endpoint: str = "/v1/chat/completions") -> Any:
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).text.splitlines()]
