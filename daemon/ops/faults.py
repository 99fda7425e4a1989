"""Test hook: make the engine hang or die after a number of steps.

``BATCHD_TEST_ENGINE_FAULT=hang:<n>`` blocks the engine thread for good after
its n-th step (as a hung GPU kernel would: the heartbeat thread carries on, the
loop never turns again); ``raise:<n>`` raises instead (as an engine error
would). The supervisor tests use it to check that watchdog pings stop and that
a dead engine means a non-zero exit. Unset (always, outside tests), each step
costs one comparison.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

ENV_VAR = "BATCHD_TEST_ENGINE_FAULT"
KINDS = ("hang", "raise")


class EngineFailure(RuntimeError):
    """The engine failure ``raise:<n>`` simulates."""


class EngineFaults:
    """Counts steps; on the armed one, hangs or raises."""

    def __init__(self, spec: str | None) -> None:
        self.kind: str | None = None
        self.at_step = 0
        if spec:
            kind, _, count = spec.partition(":")
            if kind not in KINDS:
                raise ValueError(f"{ENV_VAR}={spec!r}: unknown fault {kind!r} (one of {KINDS})")
            self.kind, self.at_step = kind, int(count or "1")
        self.steps = 0

    @classmethod
    def from_env(cls) -> EngineFaults:
        return cls(os.environ.get(ENV_VAR))

    def stepped(self) -> None:
        if self.kind is None:
            return
        self.steps += 1
        if self.steps < self.at_step:
            return
        if self.kind == "raise":
            raise EngineFailure(f"test fault after step {self.steps}")
        log.warning("test fault: engine thread hangs after step %d", self.steps)
        while True:  # signal handlers still run; the loop never turns again
            threading.Event().wait(3600)
