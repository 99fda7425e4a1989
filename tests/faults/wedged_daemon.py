"""A daemon whose engine wedges: ``python -m faults.wedged_daemon URL CONSUMER STEPS``
serves with the fake engine, whose step never returns after STEPS steps (a hung
kernel, a deadlock). Run as a subprocess: the stall makes it exit."""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

from batchd.daemon.worker.loop import Worker
from batchd.engine.outputs import RequestOutput
from support.daemon_harness import FakeGenerator, fast_settings

# Work and no completed step for this long is a stall. Seconds, not less: a loaded host
# may hold a healthy step (and its publish) for a good part of a second, and the healthy
# daemon of the test, in the test's own process, obeys the same rule.
STALL_TIMEOUT_S = 3.0


@dataclass
class WedgedGenerator(FakeGenerator):
    steps_left: int = 0

    def step(self) -> list[RequestOutput]:
        if self.steps_left <= 0:
            threading.Event().wait()
        self.steps_left -= 1
        return super().step()


def main(url: str, consumer: str, steps: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    settings = fast_settings(url, stall_timeout_s=STALL_TIMEOUT_S)
    Worker(settings, WedgedGenerator(step_delay_s=0.01, steps_left=steps), consumer=consumer).run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
