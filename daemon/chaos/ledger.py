"""What the run's producers, subscribers and injector saw, for the final checks.

Threads write, the checks read once every thread has stopped; one lock guards all.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from batchd.producers.schema import Event


@dataclass(frozen=True)
class HostileSend:
    entry_id: str
    sent_at: float  # monotonic, when XADD answered
    entry: dict[str, bytes]


@dataclass
class Ledger:
    lock: threading.Lock = field(default_factory=threading.Lock)
    # job id -> the events its subscriber delivered, in order (across resumes)
    delivered: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    gaps: dict[str, str] = field(default_factory=dict)  # job id -> what the follower refused
    submitted: set[str] = field(default_factory=set)
    resubmitted: set[str] = field(default_factory=set)  # lost with Redis, submitted again
    cancel_answers: dict[str, bool] = field(default_factory=dict)
    unknown_cancels: int = 0  # cancels of ids never submitted, answered JobNotFound
    wrong_answers: list[str] = field(default_factory=list)
    hostile: list[HostileSend] = field(default_factory=list)
    hostile_unanswered: int = 0  # XADDs cut off by a fault: may or may not exist
    # Entries a crash took from the queue (resent since): a daemon that had read one
    # before the crash may still dead-letter it from memory, once.
    hostile_lost: set[str] = field(default_factory=set)
    faults: Counter[str] = field(default_factory=Counter)
    fault_log: list[str] = field(default_factory=list)
    cuts: list[float] = field(default_factory=list)  # Redis crashes: writes after may be lost
    resumes: int = 0
    finished_at: dict[str, float] = field(default_factory=dict)  # job id -> monotonic
    started: float = field(default_factory=time.monotonic)

    def deliver(self, job_id: str, event: Event) -> None:
        with self.lock:
            self.delivered[job_id].append(event)
            if event.final:
                self.finished_at[job_id] = time.monotonic()

    def finished_within(self, seconds: float) -> list[str]:
        """Jobs whose final event came in the last ``seconds``: their results still exist."""
        horizon = time.monotonic() - seconds
        with self.lock:
            return [job_id for job_id, at in self.finished_at.items() if at >= horizon]

    def fault(self, kind: str, detail: str) -> None:
        with self.lock:
            self.faults[kind] += 1
            self.fault_log.append(f"{time.monotonic() - self.started:7.1f}s {kind}: {detail}")

    def wrong(self, what: str) -> None:
        with self.lock:
            self.wrong_answers.append(what)
