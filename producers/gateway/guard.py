"""Who may ask, how much they may send, and how much they may have running.

API keys are optional (none configured: open, for a gateway on 127.0.0.1).
Keys are compared in constant time. The in-flight limit is per key (per
client address when keys are off) and per gateway process: a request holds
a slot from submit until its answer is sent or its client is gone.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter

from starlette.requests import Request

from batchd.producers.gateway.errors import APIError, too_busy


class Guard:
    """API keys, body size and per-key jobs in flight."""

    def __init__(
        self, api_keys: list[str], *, max_body_bytes: int, max_in_flight_per_key: int
    ) -> None:
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight_per_key
        self.in_flight: Counter[str] = Counter()

    def caller(self, request: Request) -> str:
        """The caller's identity (its key, or its address when keys are off); 401 if the
        key is missing or unknown."""
        if not self.api_keys:
            return request.client.host if request.client else "anonymous"
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() == "bearer" and any(hmac.compare_digest(given, k) for k in self.api_keys):
            return given.decode()
        raise APIError(
            401,
            "Incorrect API key provided" if token else "Missing API key (Authorization: Bearer)",
            code="invalid_api_key",
        )

    def owner(self, request: Request) -> str | None:
        """Whose files and batches a request may see: a digest of its key (never the key
        itself, which is not stored), or None when keys are off (everything is shared)."""
        caller = self.caller(request)
        return hashlib.sha256(caller.encode()).hexdigest()[:24] if self.api_keys else None

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past ``max_body_bytes`` without reading it all."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )

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
