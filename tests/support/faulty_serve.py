"""``batchd serve`` with a fault built in by test subclasses, for tests that run the
daemon as a process: ``python -m support.faulty_serve [FAULT...] -- BATCHD-ARGS``.

The product has no fault hook of its own: this entry swaps the engine adapter and
the worker that ``batchd serve`` builds (batchd.daemon.worker.mlx_generator.MLXGenerator
and batchd.daemon.worker.loop.Worker, looked up when it serves) for subclasses, then
runs the real command line. Faults:

- ``--crash POINT:N``: SIGKILL (no cleanup, exactly like a crash) the N-th time the
  daemon reaches POINT: ``prefill`` (a step that computed a prompt chunk returned;
  nothing published), ``decode`` (a decode-only step returned; its tokens not
  published), ``between_steps`` (a publish stored events; the next step has not
  run), ``after_final_event`` (a publish stored a final event and final status; no
  XACK sent), ``after_status`` (the publish carrying a finished job's XACK is about
  to be sent), ``in_flight`` (a publish running beside a step, on the publishing
  thread: Redis ran it, the daemon has not seen its replies).
- ``--hang N`` / ``--raise N``: after its N-th step the engine blocks for good (a hung
  kernel: the heartbeat thread carries on, the loop never turns again) or raises.
- ``--poison TOKEN``: a poison job: the engine crashes (SIGKILL) at the first step
  after a job whose prompt holds token id TOKEN entered it, batched or alone.
- ``--overlap-ms MS``: take the path of an engine off the CPU (a GPU): publishes run
  beside steps, each step made to last at least MS ms (the overlap rule skips short
  steps, batchd.daemon.worker.cadence.OVERLAP_MIN_STEP_S).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from batchd.daemon.cli import main as batchd_main
from batchd.daemon.worker import loop, mlx_generator
from batchd.daemon.worker.generator import JobStart
from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.publisher import Flush, FlushResult, Piggyback, Publisher
from batchd.engine.outputs import ChunkKind, FinishReason, RequestOutput

log = logging.getLogger(__name__)

POINTS = (
    "prefill",
    "decode",
    "between_steps",
    "after_final_event",
    "after_status",
    "in_flight",
)


class EngineFailure(RuntimeError):
    """The engine failure ``--raise`` simulates."""


class Faults:
    """The faults this process is armed with (set once by ``main``)."""

    def __init__(self, args: argparse.Namespace | None = None) -> None:
        self.point, self.left = None, 0
        self.hang_after = self.raise_after = self.overlap_ms = self.poison = None
        if args is None:
            return
        self.hang_after, self.raise_after = args.hang_after, args.raise_after
        self.poison = args.poison
        self.overlap_ms = args.overlap_ms
        if args.crash:
            point, _, count = args.crash.partition(":")
            if point not in POINTS:
                raise SystemExit(f"--crash {args.crash}: unknown point (one of {POINTS})")
            self.point, self.left = point, int(count or "1")

    def reached(self, point: str) -> None:
        """Count a pass through ``point``; SIGKILL this process on the armed pass."""
        if point != self.point:
            return
        self.left -= 1
        if self.left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


FAULTS = Faults()


class FaultyGenerator(mlx_generator.MLXGenerator):
    """The engine adapter: crash points after a step, hangs, raises, a GPU's publish path."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.steps = 0
        self.poisoned: str | None = None
        if FAULTS.overlap_ms is not None:
            self.steps_use_cpu = False

    def start(self, job: JobStart) -> FinishReason | None:
        if FAULTS.poison is not None and FAULTS.poison in (job.prompt_token_ids or []):
            self.poisoned = job.job_id
        return super().start(job)

    def step(self) -> list[RequestOutput]:
        if self.poisoned is not None:
            log.warning("test fault: poison job %s crashes the engine", self.poisoned)
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.monotonic()
        outputs = super().step()
        if FAULTS.overlap_ms is not None:
            time.sleep(max(0.0, FAULTS.overlap_ms / 1000 - (time.monotonic() - began)))
        self.steps += 1
        prefill = any(c.kind is ChunkKind.prefill for c in self.stats().chunks)
        FAULTS.reached("prefill" if prefill else "decode")
        if self.steps == FAULTS.raise_after:
            raise EngineFailure(f"test fault after step {self.steps}")
        if self.steps == FAULTS.hang_after:
            log.warning("test fault: engine thread hangs after step %d", self.steps)
            while True:  # signal handlers still run; the loop never turns again
                threading.Event().wait(3600)
        return outputs


class InFlight(Flush):
    """A pipeline whose execution on the publishing thread is a crash point."""

    def execute(self) -> list[Any]:
        replies = super().execute()
        if threading.current_thread().name.startswith("batchd-publish"):
            FAULTS.reached("in_flight")
        return replies


class CrashingPublisher(Publisher):
    """The publisher with the crash points around a publish."""

    def prepare(self, jobs: Iterable[Job], extras: Sequence[Piggyback] = ()) -> Flush | FlushResult:
        prepared = super().prepare(jobs, extras)
        if isinstance(prepared, FlushResult):
            return prepared
        if prepared.finishing:
            FAULTS.reached("after_status")
        return InFlight(prepared.pipe, prepared.writing, prepared.finishing, prepared.extras)

    def settle(self, flush: Flush, replies: list[Any]) -> FlushResult:
        result = super().settle(flush, replies)
        if any(sent.job.stored_final for sent in flush.writing):
            FAULTS.reached("after_final_event")
        if result.published_events:
            FAULTS.reached("between_steps")
        return result


class FaultyWorker(loop.Worker):
    """The worker, publishing through the CrashingPublisher."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cadence.publisher = CrashingPublisher(
            self.redis, self.keys, owner=self.consumer, result_ttl_s=self.settings.result_ttl_s
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m support.faulty_serve", description=__doc__)
    p.add_argument("--crash", metavar="POINT:N")
    p.add_argument("--hang", dest="hang_after", type=int, metavar="N")
    p.add_argument("--raise", dest="raise_after", type=int, metavar="N")
    p.add_argument("--overlap-ms", type=float, metavar="MS")
    p.add_argument("--poison", type=int, metavar="TOKEN")
    p.add_argument("batchd", nargs=argparse.REMAINDER, help="-- then batchd's arguments")
    args = p.parse_args(argv)
    global FAULTS
    FAULTS = Faults(args)
    # What ``batchd serve`` looks up when it serves.
    mlx_generator.MLXGenerator = FaultyGenerator  # type: ignore[misc]
    loop.Worker = FaultyWorker  # type: ignore[misc]
    rest = args.batchd[1:] if args.batchd[:1] == ["--"] else args.batchd
    return batchd_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
