"""What the supervisor hears: READY once serving, STATUS for people, WATCHDOG while alive.

``alive`` is called by the worker loop on the engine thread, once per turn of
the loop (a step, or an idle read of at most ``daemon.block_ms``). So the
watchdog pings stop exactly when the loop stops turning (a hung engine step, a
deadlock), and systemd kills and restarts the daemon after ``WatchdogSec=``.
Pings go out at half the period; STATUS at most once a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchd.daemon.ops.notify import Notifier, watchdog_period_s

STATUS_INTERVAL_S = 1.0


class Supervisor:
    """sd_notify on behalf of the loop: readiness, status lines, watchdog pings."""

    def __init__(
        self,
        notifier: Notifier,
        *,
        watchdog_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.notifier = notifier
        self.ping_every_s = None if watchdog_s is None else watchdog_s / 2
        self.clock = clock
        self.next_ping = 0.0
        self.next_status = 0.0

    @classmethod
    def from_env(cls) -> Supervisor:
        return cls(Notifier.from_env(), watchdog_s=watchdog_period_s())

    def ready(self, status: str) -> None:
        """The model is loaded and the groups are joined: jobs will be taken from now on."""
        self.notifier.send("READY=1", f"STATUS={status}")
        self.next_status = self.clock() + STATUS_INTERVAL_S

    def alive(self, status: Callable[[], str]) -> None:
        """The loop turned: ping the watchdog when due, refresh the status line when due."""
        if not self.notifier.enabled:
            return
        now = self.clock()
        lines = []
        if self.ping_every_s is not None and now >= self.next_ping:
            lines.append("WATCHDOG=1")
            self.next_ping = now + self.ping_every_s
        if now >= self.next_status:
            lines.append(f"STATUS={status()}")
            self.next_status = now + STATUS_INTERVAL_S
        if lines:
            self.notifier.send(*lines)

    def stopping(self, status: str) -> None:
        self.notifier.send("STOPPING=1", f"STATUS={status}")

    def failed(self, reason: str) -> None:
        """The daemon is about to exit non-zero: ``systemctl status`` shows why."""
        self.notifier.send("STOPPING=1", f"STATUS=failed: {reason}")
