"""sd_notify(3): the few lines of systemd's notification protocol.

systemd passes a datagram socket in ``NOTIFY_SOCKET`` (a path, or ``@name`` in
the abstract namespace) and, with ``WatchdogSec=``, the watchdog period in
``WATCHDOG_USEC`` (for the process ``WATCHDOG_PID``, when set). Outside systemd
the variables are absent and every call is a no-op. Sending never raises: a
supervisor that went away must not take the daemon with it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends ``KEY=value`` lines to systemd's notification socket, if there is one."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> None:
        """One datagram of ``lines`` (e.g. ``"READY=1"``, ``"STATUS=..."``)."""
        if self.address is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto("\n".join(lines).encode(), target)
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify systemd at %s: %s", self.address, exc)
            self._failed = True


def watchdog_period_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The watchdog period systemd expects pings within, if it set one for this process."""
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000
