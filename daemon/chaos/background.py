"""The chaos run's background threads: started once, stopped on request, and a thread
that breaks keeps its error for the verdict instead of hanging the run."""

from __future__ import annotations

import logging
import threading
from typing import TypeVar

log = logging.getLogger(__name__)

SelfT = TypeVar("SelfT", bound="Background")


class Background:
    """Subclasses implement :meth:`work`, which returns soon after ``stop`` is set."""

    def __init__(self, name: str, *, join_timeout_s: float) -> None:
        self.name = name
        self.join_timeout_s = join_timeout_s
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def work(self) -> None:
        raise NotImplementedError

    def start(self: SelfT) -> SelfT:
        self._thread.start()
        return self

    def join(self) -> None:
        """Ask the thread to stop and wait for it (at most ``join_timeout_s``)."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(self.join_timeout_s)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # a part that dies is a finding, not a hang
            log.exception("chaos %s failed", self.name)
            self.error = exc
