"""What a dashboard is started with (``batchd dashboard``'s flags, in one value)."""

from __future__ import annotations

from dataclasses import dataclass

from batchd.config.limits import LimitSettings
from batchd.producers.keys import DEFAULT_PREFIX, DEFAULT_QUEUE

# An operator key cancels jobs and re-drives letters fleet-wide: too short a key could be
# guessed over HTTP, so short ones are refused at start.
MIN_OPERATOR_KEY_CHARS = 16


@dataclass(frozen=True)
class DashboardOptions:
    """The dashboard's settings; every interval in seconds.

    ``operator_keys`` empty: the dashboard is read-only for everyone. ``private``: every
    page needs an operator session too (prompts and outputs are user data). The
    overview is probed every ``refresh_s`` and keeps ``history_points`` samples for its
    charts; the keyspace is walked for new queues, daemons and gateways every ``discovery_s``.
    """

    prefix: str = DEFAULT_PREFIX
    queue: str = DEFAULT_QUEUE
    operator_keys: tuple[str, ...] = ()
    private: bool = False
    refresh_s: float = 1.0
    history_points: int = 300
    discovery_s: float = 15.0
    session_ttl_s: float = 12 * 3600
    # Keys one search request may walk (SCAN), and jobs one page shows.
    search_scan_keys: int = 20_000
    page_size: int = 50
    # Waiting entries read per queue and refresh to count them by priority band.
    band_sample: int = 500
    # Subscribe to the token channels to measure TTFT and ITL from final events.
    latency: bool = True
    limits: LimitSettings | None = None

    def __post_init__(self) -> None:
        for key in self.operator_keys:
            if len(key) < MIN_OPERATOR_KEY_CHARS or key != key.strip():
                raise ValueError(
                    f"an operator key needs at least {MIN_OPERATOR_KEY_CHARS} characters "
                    "and no surrounding whitespace"
                )
        if self.private and not self.operator_keys:
            raise ValueError("a private dashboard needs an operator key")
        if self.refresh_s <= 0 or self.history_points < 2:
            raise ValueError("refresh_s must be above 0 and history_points at least 2")
