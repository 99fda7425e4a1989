"""Who may ask, how much they may send, and how much they may have running.

API keys are optional (none configured: open, for a gateway on 127.0.0.1; every
caller then shares one owner). An empty or blank key is refused at start: it would
make a bare ``Authorization: Bearer`` header authenticate. A presented key is compared
with every configured key in constant time (``hmac.compare_digest``, no early exit),
so the answer's timing says nothing of which key or how much of one matched. A caller
is known by its key id (:func:`~batchd.producers.gateway.store.key_id`), never by the
key. The in-flight limit is per key (per client address when keys are off) and per
gateway process: a request holds a slot from submit until its answer is sent or its
client is gone.
"""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.requests import Request
from starlette.types import Message

from batchd.producers.gateway.errors import APIError, too_busy
from batchd.producers.gateway.store import OPEN_KEY_ID, key_id


def checked_keys(api_keys: Iterable[str]) -> list[str]:
    """The keys, surrounding whitespace trimmed (a Bearer token never carries any);
    ValueError for an empty or blank one."""
    keys = []
    for index, raw in enumerate(api_keys):
        key = raw.strip()
        if not key:
            raise ValueError(f"API key {index + 1} is empty: every key must be a non-blank string")
        keys.append(key)
    return keys


def parse_key_list(text: str) -> list[str]:
    """Keys from a comma-separated list (``$BATCHD_GATEWAY_API_KEYS``): each trimmed, the
    empty parts between commas skipped."""
    return [part.strip() for part in text.split(",") if part.strip()]


class Guard:
    """API keys, body size and per-key jobs in flight."""

    def __init__(
        self,
        api_keys: list[str],
        *,
        max_body_bytes: int,
        max_in_flight_per_key: int,
        body_timeout_s: float = 60.0,
    ) -> None:
        self._keys = [(k.encode(), key_id(k)) for k in checked_keys(api_keys)]
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight_per_key
        self.body_timeout_s = body_timeout_s
        self.in_flight: Counter[str] = Counter()

    @property
    def keys_on(self) -> bool:
        return bool(self._keys)

    def owner(self, request: Request) -> str:
        """The key id of the request's key (every record and job it makes carries it);
        ``open`` when keys are off. 401 if the key is missing or unknown."""
        if not self._keys:
            return OPEN_KEY_ID
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        found = None
        for key, ident in self._keys:  # every key compared: no early exit
            if hmac.compare_digest(given, key):
                found = ident
        if scheme.lower() == "bearer" and given and found is not None:
            return found
        raise APIError(
            401,
            "Incorrect API key provided" if given else "Missing API key (Authorization: Bearer)",
            code="invalid_api_key",
        )

    def caller(self, request: Request) -> str:
        """Whose in-flight slots a request takes: its key id, or its address when keys
        are off; 401 as :meth:`owner`."""
        owner = self.owner(request)
        if self._keys:
            return owner
        return request.client.host if request.client else "anonymous"

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past ``max_body_bytes`` without reading it all
        (counted on the bytes received, whatever Content-Length says), and (408) when it
        takes longer than ``body_timeout_s`` to arrive."""
        chunks = []
        async with self.reading():
            async for chunk in self.limited(request, self.max_body_bytes).stream():
                chunks.append(chunk)
        return b"".join(chunks)

    def limited(self, request: Request, limit: int, *, param: str | None = None) -> Request:
        """``request`` whose body raises 413 (naming ``param``) once more than ``limit``
        bytes have arrived; a declared Content-Length past it is refused unread."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit, param)
        received = 0

        async def receive() -> Message:
            nonlocal received
            message = await request.receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit, param)
            return message

        return Request(request.scope, receive)

    def reading(self) -> Any:
        """A scope that ends a body read with 408 after ``body_timeout_s``."""
        return _deadline(self.body_timeout_s)

    def acquire(self, caller: str) -> None:
        """Take one in-flight slot of ``caller`` (give it back with :meth:`release`);
        429 with Retry-After when all are taken."""
        if self.in_flight[caller] >= self.max_in_flight:
            raise too_busy(
                f"too many requests in flight for this key (limit {self.max_in_flight})",
                code="rate_limit_exceeded",
            )
        self.in_flight[caller] += 1

    def release(self, caller: str) -> None:
        self.in_flight[caller] -= 1
        if self.in_flight[caller] <= 0:
            del self.in_flight[caller]


def too_large(limit: int, param: str | None = None) -> APIError:
    what = "file" if param == "file" else "request body"
    return APIError(413, f"{what} exceeds {limit} bytes", param=param, code="request_too_large")


@asynccontextmanager
async def _deadline(seconds: float) -> AsyncIterator[None]:
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {seconds:g} s", code="request_timeout"
        ) from None
