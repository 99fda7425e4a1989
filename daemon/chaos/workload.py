"""The seeded jobs of a chaos run and what each producer does with them.

Everything is drawn from one ``random.Random(seed)``, so a run and its fault-free
reference see the same requests, and a failing seed can be run again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Via(str, Enum):
    """How a job reaches the queue."""

    client = "client"  # Client.submit: the status hash and the entry in one script
    xadd = "xadd"  # a bare XADD, as a producer in another language would


class CancelAt(str, Enum):
    """When its producer asks to cancel a job."""

    queued = "queued"  # right after submitting it
    running = "running"  # once a token has been seen
    finished = "finished"  # after its final event (the answer must be False)


@dataclass(frozen=True)
class ChaosJob:
    payload: dict[str, Any]
    via: Via
    duplicate: bool  # submitted twice: the second must not run it again
    cancel: CancelAt | None

    @property
    def id(self) -> str:
        job_id: str = self.payload["id"]
        return job_id


def make_jobs(count: int, seed: int, *, vocab: int) -> list[ChaosJob]:
    """``count`` jobs: short mixed prompts and outputs, a third each greedy, seeded and
    sampled without a seed (which the daemon samples with ``job_seed(id)``)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        payload: dict[str, Any] = {
            "id": f"chaos-{seed}-{i}",
            "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(2, 48))],
            "max_tokens": rng.randint(2, 24),
        }
        sampling = rng.random()
        if sampling < 2 / 3:
            payload.update(temperature=0.9, top_p=0.95)
        if sampling < 1 / 3:
            payload.update(seed=rng.randrange(2**31))
        roll = rng.random()
        cancel = None
        if roll < 0.01:
            cancel = CancelAt.queued
        elif roll < 0.03:
            cancel = CancelAt.running
        elif roll < 0.04:
            cancel = CancelAt.finished
        jobs.append(
            ChaosJob(
                payload=payload,
                via=Via.xadd if rng.random() < 0.3 else Via.client,
                duplicate=rng.random() < 0.03,
                cancel=cancel,
            )
        )
    return jobs
