"""A finished job's result, assembled from its events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producers.errors import JobFailed
from producers.schema import Event, FinishReason, Timings, Usage

FAILED_REASONS = (FinishReason.error, FinishReason.cancelled, FinishReason.expired)


@dataclass(frozen=True)
class JobResult:
    """What a job produced. ``text`` is the full generated text (stop strings removed)."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage | None = None
    timings: Timings | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
            "usage": None if self.usage is None else self.usage.model_dump(),
            "timings": None if self.timings is None else self.timings.model_dump(),
            "metadata": self.metadata,
        }


class ResultBuilder:
    """Feed a job's events in seq order; the final one yields the result."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.token_ids: list[int] = []
        self.pieces: list[str] = []

    def add(self, event: Event) -> JobResult | None:
        """None until the final event; raises JobFailed if the job did not finish well."""
        if not event.final:
            if event.token_id is not None:
                self.token_ids.append(event.token_id)
            self.pieces.append(event.text)
            return None
        assert event.finish_reason is not None
        if event.finish_reason in FAILED_REASONS:
            raise JobFailed(self.job_id, event.finish_reason.value, event.error)
        return JobResult(
            id=self.job_id,
            text=event.text or "".join(self.pieces),
            token_ids=self.token_ids,
            finish_reason=event.finish_reason,
            usage=event.usage,
            timings=event.timings,
            metadata=event.metadata or {},
        )
