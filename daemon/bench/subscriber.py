"""The queue workload's client, run the way the daemon's clients run in production.

Producers and subscribers are other services, on other machines or at their own
priority: what the queue workload measures is the queue layer (the daemon and Redis),
not a consumer that happens to share the bench's cores. On a 2-core host the
subscriber, woken by every publish, would otherwise run in the middle of the engine's
next step, and the engine's threads, which wait for each other at the end of every
product, all stall for it. At the lowest priority it takes the cores the engine leaves:
the daemon's publish round trips and the end of the run, when the last token arrives.
(Alternating queue rounds with and without, within one bench-small run on 2 cores:
see docs/bench/HISTORY.md, Subscriber at nice 19.) Its CPU time is still reported.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The lowest CPU priority a process may give one of its threads without privileges.
SUBSCRIBER_NICE = 19


def run_as_subscriber(work: Callable[[], T]) -> tuple[T, int | None]:
    """``work``'s result, computed on a thread of its own at SUBSCRIBER_NICE where the
    platform sets a priority per thread (Linux), with the niceness it ran at (None where
    it ran at the process's own); ``work``'s exception is raised here. A fresh thread each
    call, since a thread cannot raise its priority back; a daemon thread, so that an
    interrupted bench does not wait for a follow blocked on Redis."""
    outcome: list[tuple[T, int | None]] = []
    failure: list[BaseException] = []

    def at_low_priority() -> None:
        try:
            nice = _lower_this_thread()
            outcome.append((work(), nice))
        except BaseException as exc:  # raised again on the calling thread
            failure.append(exc)

    thread = threading.Thread(target=at_low_priority, name="batchd-bench-subscriber", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def _lower_this_thread() -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SUBSCRIBER_NICE)
    except OSError:  # a sandbox refusing setpriority: run at the process's priority
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
