"""What one gateway is told: the ``[gateway]`` settings, plus what the process knows.

:class:`GatewayOptions` holds plain values; its defaults are
:class:`~batchd.config.sections.GatewaySettings`' (the one definition of each option), and
:meth:`GatewayOptions.from_settings` takes a whole section with the command's flags on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from batchd.config.limits import LimitSettings
from batchd.config.paths import gateway_files
from batchd.config.sections import RQ_QUEUE, GatewaySettings
from batchd.producers.keys import DEFAULT_PREFIX

_D = GatewaySettings()


@dataclass
class GatewayOptions:
    """What ``batchd gateway`` is told; every bound is per gateway process (see
    :class:`~batchd.config.sections.GatewaySettings` for each option)."""

    queue: str = _D.queue
    prefix: str = DEFAULT_PREFIX
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = _D.max_body_bytes
    max_file_bytes: int = _D.max_file_bytes
    max_in_flight_per_key: int = _D.max_in_flight_per_key
    max_backlog: int = _D.max_backlog
    files_dir: Path = field(default_factory=gateway_files)
    batch_window: int = _D.batch_window
    limits: LimitSettings | None = field(default_factory=LimitSettings)
    rq_queue: str = RQ_QUEUE
    rq_redis_url: str | None = None  # rq's own Redis (bulk.rq_redis_url); None: the gateway's
    default_max_tokens: int = _D.default_max_tokens
    body_timeout_s: float = _D.body_timeout_s
    sse_keepalive_s: float = _D.sse_keepalive_s
    redis_max_connections: int = _D.redis_max_connections
    redis_pool_timeout_s: float = _D.redis_pool_timeout_s
    redis_retry_s: float = _D.redis_retry_s
    metrics: bool = _D.metrics

    @classmethod
    def from_settings(cls, section: GatewaySettings, **values: Any) -> GatewayOptions:
        """The section's options that the app reads, with ``values`` (prefix, keys,
        files_dir, limits, flags given) on top; None values are ignored."""
        names = {f.name for f in fields(cls)}
        own = {k: v for k, v in section.model_dump().items() if k in names}
        own.update({k: v for k, v in values.items() if v is not None})
        return cls(**own)
