"""OpenAI's error shape, so every SDK turns a gateway refusal into its usual exception.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status the
OpenAI API uses for the same case (400 bad parameter, 401 bad key, 404 unknown
model or object, 413 body too large, 429 too busy, 503 Redis unreachable or refusing
writes). Messages never carry the Redis URL nor Redis's own error text (an ACL error
names the user): Redis failures get a fixed text per kind (:func:`redis_failure`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis


# repr=False keeps Exception's repr; eq=False keeps exceptions hashable by identity.
@dataclass(repr=False, eq=False)
class APIError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the request field at fault."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def unsupported(param: str, why: str = "is not supported by batchd") -> APIError:
    """A parameter the engine cannot honour: refused, never silently ignored."""
    return APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def too_busy(message: str, *, code: str, retry_after_s: int = 1) -> APIError:
    """429 with Retry-After: the client should come back, not wait on an open request."""
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def not_found(what: str, ident: str, *, param: str | None = None, code: str) -> APIError:
    return APIError(404, f"{what} {ident!r} does not exist", param=param, code=code)


REDIS_DOWN = APIError(
    503,
    "the job store (Redis) is unreachable; retry later",
    type="server_error",
    code="unavailable",
)


def _refusing(why: str) -> APIError:
    return APIError(
        503, f"the job store (Redis) {why}; retry later", type="server_error", code="unavailable"
    )


# Redis up but refusing what the request needs: said as such, not as "unreachable".
_REFUSALS: tuple[tuple[type[Exception], APIError], ...] = (
    (redis.exceptions.OutOfMemoryError, _refusing("is out of memory and refuses writes")),
    (redis.exceptions.ReadOnlyError, _refusing("is a read-only replica (a failover?)")),
    (redis.exceptions.NoPermissionError, _refusing("refuses the gateway's user (an ACL)")),
    (redis.ResponseError, _refusing("refused the request")),
)


def redis_failure(exc: BaseException) -> APIError:
    """The 503 for a Redis failure: unreachable, or up and refusing (each kind its text)."""
    for kind, error in _REFUSALS:
        if isinstance(exc, kind):
            return error
    return REDIS_DOWN
