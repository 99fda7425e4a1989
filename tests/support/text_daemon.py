"""The real daemon (the Worker, its Redis side untouched) over an engine of predictable text.

Producer tests need a daemon whose output they can predict without a model:
this runs the product's own Worker on a thread, with :class:`TextGenerator`
as its engine. Token ``i`` of a job is character ``i`` of its prompt (cycled),
so a job's text is :func:`expected_text`; a prompt starting with ``!fail``
ends in an engine error ("fake failure") after one token. So the clients are
tested against the daemon they will meet, not a copy of its protocol.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from batchd.daemon.worker.generator import Generator, JobStart
from batchd.engine.outputs import FinishReason, RequestOutput, StepStats
from batchd.producers.schema import JobRequest
from support.daemon_harness import fast_settings, step_stats, token_output, worker_thread


def prompt_text(job: JobRequest) -> str:
    if job.prompt is not None:
        return job.prompt or "x"
    if job.messages is not None:
        return job.messages[-1].content or "x"
    return "".join(chr(97 + t % 26) for t in job.prompt_token_ids or [0])


def expected_text(prompt: str, max_tokens: int) -> str:
    """The text a job with this plain prompt gets."""
    source = prompt or "x"
    return "".join(source[i % len(source)] for i in range(max_tokens))


@dataclass
class _Run:
    job_id: str
    text: str
    max_tokens: int
    emitted: int


@dataclass
class TextGenerator(Generator):
    """Every running job gets its next character each step (``token_delay_s`` apart).

    ``started`` counts how often each job id began generating (a job run twice
    shows 2); ``max_active`` is the most jobs it ran at once.
    """

    token_delay_s: float = 0.0
    max_running: int = 64
    started: Counter[str] = field(default_factory=Counter)
    max_active: int = 0
    running: dict[str, _Run] = field(default_factory=dict)

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        return [ord(c) for c in prompt_text(request)]

    def start(self, job: JobStart) -> FinishReason | None:
        if len(job.emitted) >= job.request.max_tokens:
            return FinishReason.length
        self.started[job.job_id] += 1
        text = "".join(chr(t) for t in job.prompt_token_ids)
        self.running[job.job_id] = _Run(job.job_id, text, job.request.max_tokens, len(job.emitted))
        self.max_active = max(self.max_active, len(self.running))
        return None

    def abort(self, job_id: str) -> None:
        self.running.pop(job_id, None)

    def step(self) -> list[RequestOutput]:
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        outs = []
        for run in list(self.running.values()):
            char = run.text[run.emitted % len(run.text)]
            index = run.emitted
            if run.text.startswith("!fail") and index > 0:
                # The engine's error output: the sequence ends, its token is no output.
                outs.append(
                    token_output(
                        run.job_id,
                        ord(char),
                        "",
                        index=index,
                        finish=FinishReason.error,
                        error="fake failure",
                    )
                )
                del self.running[run.job_id]
                continue
            run.emitted += 1
            done = run.emitted >= run.max_tokens and not run.text.startswith("!fail")
            finish = FinishReason.length if done else None
            outs.append(token_output(run.job_id, ord(char), char, index=index, finish=finish))
            if done:
                del self.running[run.job_id]
        return outs

    def has_work(self) -> bool:
        return bool(self.running)

    def stats(self) -> StepStats:
        stats = step_stats(0, decodes=list(self.running))
        return dataclasses.replace(stats, num_running=len(self.running))


@contextmanager
def text_daemon(
    url: str, *, token_delay_s: float = 0.0, max_active: int = 64
) -> Iterator[TextGenerator]:
    """The real Worker serving ``url`` (default queue and prefix) over a TextGenerator."""
    engine = TextGenerator(token_delay_s=token_delay_s, max_running=max_active)
    settings = fast_settings(url)
    settings.engine.max_num_seqs = max_active
    settings.engine.max_num_batched_tokens = max(settings.engine.max_num_batched_tokens, max_active)
    with worker_thread(settings, lambda: engine):
        yield engine
