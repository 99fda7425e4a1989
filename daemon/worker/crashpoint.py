"""Test hook: SIGKILL the daemon at a named point of its loop.

``BATCHD_TEST_CRASH_AT=<point>:<n>`` makes the process kill itself (SIGKILL,
no cleanup, exactly like a crash) the n-th time it reaches ``<point>``. The
durability tests use it to crash at precise moments. Points:

- ``prefill``: a step that computed a prompt chunk returned; nothing published
- ``decode``: a decode-only step returned; its tokens are not published yet
- ``between_steps``: a step's events are stored; the next step has not run
- ``after_final_event``: a flush confirmed a final event and its final status; no
  XACK was sent
- ``after_status``: the flush carrying a finished job's XACK is about to be sent

Both finish points sit on the path production takes: the final event and status
go in one flush, the XACK only in a later one (batchd.daemon.worker.publisher). Unset
(always, outside tests), every check is one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "BATCHD_TEST_CRASH_AT"
POINTS = ("prefill", "decode", "between_steps", "after_final_event", "after_status")


def _parse(spec: str | None) -> dict[str, int]:
    if not spec:
        return {}
    point, _, count = spec.partition(":")
    if point not in POINTS:
        raise ValueError(f"{ENV_VAR}={spec!r}: unknown point {point!r} (one of {POINTS})")
    return {point: int(count or "1")}


_armed = _parse(os.environ.get(ENV_VAR))


def reached(point: str) -> None:
    """Count a pass through ``point``; SIGKILL this process on the armed pass."""
    left = _armed.get(point)
    if left is None:
        return
    if left <= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _armed[point] = left - 1
