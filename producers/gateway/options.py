"""What ``batchd gateway`` is told (its command-line options, as one object)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchd.config.limits import LimitSettings
from batchd.producers.keys import DEFAULT_PREFIX, DEFAULT_QUEUE


@dataclass
class GatewayOptions:
    """What ``batchd gateway`` is told; every bound is per gateway process."""

    queue: str = DEFAULT_QUEUE
    prefix: str = DEFAULT_PREFIX
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 << 20
    max_file_bytes: int = 200 << 20
    max_in_flight_per_key: int = 256
    max_backlog: int = 1024
    files_dir: Path = Path(".batchd/gateway-files")
    batch_window: int = 64
    limits: LimitSettings | None = field(default_factory=LimitSettings)
