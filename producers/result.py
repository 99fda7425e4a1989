"""A finished job's result, assembled from its events."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any

from batchd.producers.errors import JobFailed, ProtocolError
from batchd.producers.schema import Choice, Event, FinishReason, Timings, Usage

FAILED_REASONS = (FinishReason.error, FinishReason.cancelled, FinishReason.expired)


@dataclass(frozen=True)
class SequenceResult:
    """One of the n sequences of a job (``index`` 0 to n-1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
        }


@dataclass(frozen=True)
class JobResult:
    """What a job produced. ``text`` is the full generated text (stop strings removed).

    ``choices`` holds every sequence of the job, in index order (one for n=1); ``text``,
    ``token_ids`` and ``finish_reason`` are sequence 0's, ``usage`` counts them all.
    ``prompt_logprobs`` (jobs that asked) pairs each prompt token with its logprob given
    the ones before it (None for the first).
    """

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage | None = None
    timings: Timings | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    choices: list[SequenceResult] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, float | None]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON; ``choices`` only for a job with n > 1, ``prompt_logprobs`` only
        when asked for."""
        data: dict[str, Any] = {
            "id": self.id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
            "usage": None if self.usage is None else self.usage.model_dump(),
            "timings": None if self.timings is None else self.timings.model_dump(),
            "metadata": self.metadata,
        }
        if len(self.choices) > 1:
            data["choices"] = [choice.to_dict() for choice in self.choices]
        if self.prompt_logprobs is not None:
            data["prompt_logprobs"] = self.prompt_logprobs
        return data


class ResultBuilder:
    """Feed a job's events in seq order; the final one yields the result."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        # sequence index -> its token ids and text pieces
        self.token_ids: dict[int, list[int]] = {}
        self.pieces: dict[int, list[str]] = {}
        self.prompt_logprobs: list[tuple[int, float | None]] | None = None

    def add(self, event: Event) -> JobResult | None:
        """None until the final event; raises JobFailed if the job did not finish well."""
        index = event.index or 0
        if not event.final:
            if event.prompt_logprobs is not None:
                self.prompt_logprobs = event.prompt_logprobs
            if event.token_id is not None:
                self.token_ids.setdefault(index, []).append(event.token_id)
            self.pieces.setdefault(index, []).append(event.text)
            return None
        assert event.finish_reason is not None
        if event.finish_reason in FAILED_REASONS:
            raise JobFailed(self.job_id, event.finish_reason.value, event.error)
        ends = event.choices or [
            Choice(
                index=0,
                text=event.text or "".join(self.pieces.get(0, [])),
                finish_reason=event.finish_reason,
                completion_tokens=len(self.token_ids.get(0, [])),
            )
        ]
        choices = [
            SequenceResult(c.index, c.text, self.token_ids.get(c.index, []), c.finish_reason)
            for c in sorted(ends, key=lambda c: c.index)
        ]
        return JobResult(
            id=self.job_id,
            text=choices[0].text,
            token_ids=choices[0].token_ids,
            finish_reason=event.finish_reason,
            usage=event.usage,
            timings=event.timings,
            metadata=event.metadata or {},
            choices=choices,
            prompt_logprobs=self.prompt_logprobs,
        )


def collect(job_id: str, events: Iterable[Event]) -> JobResult:
    """The result of a job's whole event stream (raises JobFailed as ``add`` does)."""
    builder = ResultBuilder(job_id)
    for event in events:
        if (result := builder.add(event)) is not None:
            return result
    raise ProtocolError(job_id, "the events stream ended without a final event")


async def acollect(job_id: str, events: AsyncIterable[Event]) -> JobResult:
    """:func:`collect` of an asyncio stream."""
    builder = ResultBuilder(job_id)
    async for event in events:
        if (result := builder.add(event)) is not None:
            return result
    raise ProtocolError(job_id, "the events stream ended without a final event")
