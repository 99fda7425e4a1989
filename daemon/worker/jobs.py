"""A job the daemon holds: its request, its progress, and what Redis has not stored yet.

The events stream is the checkpoint: ``seq`` of a token event is its index in
``output_token_ids``, so a job rebuilt from its stored events continues at the
next seq. A job with ``n`` > 1 interleaves the tokens of its sequences in that one
seq order, each event naming its sequence; ``sequences`` holds each one's own
tokens, text and end, so each resumes from its own tokens.

Everything that must reach Redis waits in the job's outbox (``unpublished``
events, ``status`` fields, the finish flags) until one publish pipeline confirms
it; while Redis is away the outbox just grows, in order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from batchd.producers.schema import (
    FINAL_STATE,
    Choice,
    Event,
    FinishReason,
    JobRequest,
    Timings,
    Usage,
)

log = logging.getLogger(__name__)

# Two AOF ``everysec`` fsync windows and a margin: a write Redis acknowledged this long
# ago survived any crash that Redis came back from (batchd.daemon.fleet.durable).
DURABLE_AFTER_S = 3.0


@dataclass(frozen=True)
class Delivery:
    """One entry of a queue stream handed to this daemon by the consumer group: of
    partition ``partition`` of queue ``queue`` (batchd.producers.keys)."""

    queue: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1
    partition: int = 0

    @property
    def enqueued_at(self) -> float:
        """Unix seconds of enqueue: the entry id's millisecond part."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


@dataclass
class SequenceProgress:
    """One of a job's n sequences: its tokens and text so far, and how it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class Job:
    """In-memory state of one job from pickup until Redis has its final event and ack."""

    job_id: str
    delivery: Delivery
    request: JobRequest | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    # Every token event's token, in seq order (all sequences).
    output_token_ids: list[int] = field(default_factory=list)
    sequences: list[SequenceProgress] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    # The outbox: what the next publish pipeline writes, in order.
    unpublished: list[Event] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    error: str | None = None
    dead_letter: bool = False
    # The fence (batchd.daemon.worker.fence): this pickup's epoch, and how many events the
    # events stream holds as far as this daemon knows.
    epoch: int = 1
    stored_events: int = 0
    # A rejected entry whose id names a job that exists: it writes nothing of that job's.
    foreign: bool = False
    # A suspect (batchd.daemon.fleet.poison): runs with nothing else in the engine; and
    # the crashes counted against it while it ran alone.
    alone: bool = False
    alone_crashes: int = 0
    # Prompt tokens the engine took from its prefix cache (its first output says).
    cached_tokens: int | None = None
    # Its delivery is a queue entry this daemon read (not one a tool made up): its first
    # append checks that the entry is still there (batchd.daemon.worker.fence).
    from_queue: bool = False
    # Monotonic time before which a cancelled end stays in the outbox (``final_held``).
    final_not_before: float = 0.0
    # The events stored lately (2 x DURABLE_AFTER_S), each with when: a crash may still take
    # them, and a cancelled end is written back whole with them (``refill``).
    recent: deque[tuple[float, Event]] = field(default_factory=deque, repr=False)
    _key: str | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """Where the worker files this job: its id, or for an entry that may not touch the
        job it names, the entry (several bad entries may name one id). Fixed when first
        read: an entry found foreign only when its append is refused stays where it was
        filed, so the worker can still remove it."""
        if self._key is None:
            self._key = f"entry:{self.delivery.entry_id}" if self.foreign else self.job_id
        return self._key

    @property
    def next_seq(self) -> int:
        return len(self.output_token_ids)

    @property
    def n(self) -> int:
        return 1 if self.request is None else self.request.n

    def sequence(self, index: int) -> SequenceProgress:
        while len(self.sequences) <= index:
            self.sequences.append(SequenceProgress())
        return self.sequences[index]

    def end_sequence(self, index: int, reason: FinishReason) -> bool:
        """Record that sequence ``index`` ended; True once all n have."""
        self.sequence(index).finish_reason = reason
        return all(self.sequence(i).finish_reason is not None for i in range(self.n))

    @property
    def ended(self) -> bool:
        """The final event exists (in the outbox or already stored)."""
        return self.finish_reason is not None

    @property
    def stored_final(self) -> bool:
        """The final event and final status are stored: only the ack is left."""
        return self.ended and not self.unpublished and not self.status

    @property
    def urgent(self) -> bool:
        """Its outbox holds what someone waits on: the first event (time to first token)
        or the final event (unless held: ``final_held``); or it runs alone (a suspect: its
        progress must be on record before a crash, so that the crash is not blamed on
        it). (The ack left once both are stored waits on nobody, unless jobs wait for the
        room it frees: see ``PublishCadence.due``.)"""
        sendable = len(self.unpublished)
        ends = sendable > 0 and self.unpublished[-1].final
        if ends and self.final_held():
            sendable, ends = sendable - 1, False  # asked every step: no outbox copy
        return sendable > 0 and (self.alone or self.stored_events == 0 or ends)

    def final_held(self, now: float | None = None) -> bool:
        """A cancelled end waits in the outbox until the cancel request and the tokens
        before the end are durable (:data:`DURABLE_AFTER_S` after the later of the cancel
        and their storing). Its followers read the end once it is written; were Redis to
        lose that end afterwards, a run again would find the cancel and the same tokens
        and end at the same seq, cancelled. Written at once, a crash could take the cancel
        request with the end, and the run again would go on where a follower read the
        job end."""
        return self.final_not_before > (time.monotonic() if now is None else now)

    def outbox(self) -> tuple[list[Event], dict[str, str]]:
        """What the next flush may send: the whole outbox; while the end is held
        (``final_held``), the events before the final one and no status field (the
        terminal fields go with the final event)."""
        if self.unpublished and self.unpublished[-1].final and self.final_held():
            return self.unpublished[:-1], {}
        return list(self.unpublished), dict(self.status)

    def stored(self, count: int) -> None:
        """The first ``count`` events of the outbox are stored: they leave it (and join
        ``recent``). A held end waits :data:`DURABLE_AFTER_S` from now, when they are
        stored."""
        if not count:
            return
        now = time.monotonic()
        self.recent.extend((now, event) for event in self.unpublished[:count])
        while self.recent and self.recent[0][0] < now - 2 * DURABLE_AFTER_S:
            self.recent.popleft()
        del self.unpublished[:count]
        self.stored_events += count
        if self.final_held():
            self.final_not_before = now + DURABLE_AFTER_S

    def release_end(self) -> None:
        """Write a cancelled end at once: Redis loses nothing it acknowledged (AOF
        ``always``), or a crash loses so much that waiting buys nothing (no AOF)."""
        self.final_not_before = 0.0

    def refill(self, stored: int) -> bool:
        """Redis holds only ``stored`` of the events this job stored (a crash took the
        rest) and its cancelled end is still to write: put the lost events back at the
        head of the outbox, from ``recent``, so the end is written whole where its
        followers read the tokens (a run again could not: it finds the cancel and ends
        at once, at the seq Redis kept); the end then waits until they are durable
        again. False when this is not such a job, or ``recent`` lacks one."""
        if self.finish_reason is not FinishReason.cancelled or not self.unpublished:
            return False
        kept = {event.seq: event for _, event in self.recent}
        lost = [kept.get(seq) for seq in range(stored, self.stored_events)]
        if stored >= self.stored_events or any(event is None for event in lost):
            return False
        self.unpublished[:0] = [event for event in lost if event is not None]
        self.stored_events = stored
        self.final_not_before = time.monotonic() + DURABLE_AFTER_S  # durable again first
        return True

    def set_status(self, **fields: Any) -> None:
        """Queue status-hash fields for the next pipeline (values stored as strings)."""
        for key, value in fields.items():
            if value is None:
                continue
            if isinstance(value, bool):
                self.status[key] = "1" if value else "0"
            elif isinstance(value, Enum):
                self.status[key] = str(value.value)
            else:
                self.status[key] = str(value)

    def add_token(
        self,
        token_id: int,
        text: str,
        *,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
        index: int = 0,
        prompt_logprobs: list[float] | None = None,
        cached_tokens: int | None = None,
        token_texts: dict[int, str] | None = None,
        token_bytes: dict[int, bytes] | None = None,
        stop_token: bool = False,
    ) -> None:
        """Append one generated token of sequence ``index`` as the next seq, with the
        prompt's logprobs (after its first token) when they come with it; the first
        ``cached_tokens`` reported (the prefix-cache hit) goes to the final usage;
        ``token_texts`` (jobs that asked) names the token ids the event holds and
        ``token_bytes`` the bytes of those that are part of a character; ``stop_token``
        marks a stop token, which adds no text (Event.stop_token)."""
        assert not self.ended, f"job {self.job_id}: token after the final event"
        if self.cached_tokens is None and cached_tokens is not None:
            self.cached_tokens = min(cached_tokens, len(self.prompt_token_ids))
        if self.timings.first_token is None:
            self.timings.first_token = time.time()
            self.set_status(first_token_at=self.timings.first_token)
        self.unpublished.append(
            Event(
                seq=self.next_seq,
                index=index if self.n > 1 else None,
                token_id=token_id,
                text=text,
                logprob=logprob,
                top_logprobs=top_logprobs,
                token_texts=token_texts,
                token_bytes=None
                if token_bytes is None
                else {t: list(raw) for t, raw in token_bytes.items()},
                stop_token=True if stop_token else None,
                prompt_logprobs=None
                if prompt_logprobs is None
                else list(zip(self.prompt_token_ids, [None, *prompt_logprobs], strict=True)),
            )
        )
        self._take(index, token_id, text)

    def _take(self, index: int, token_id: int, text: str) -> None:
        progress = self.sequence(index)
        progress.token_ids.append(token_id)
        progress.text += text
        self.output_token_ids.append(token_id)

    def end(self, reason: FinishReason, *, error: str | None = None, metadata: bool = True) -> None:
        """Queue the final event and the terminal status; idempotent for a job already ended.
        ``metadata=False`` leaves the request's metadata out of the final event.

        With n > 1 the final event lists every sequence; one that had not ended takes
        ``reason`` (cancelled, expired, error). The event's text is sequence 0's. A
        cancelled end is held until what it stands on is durable (``final_held``)."""
        if self.ended:
            return
        self.finish_reason = reason
        self.error = error
        self.timings.finished = time.time()
        held = reason is FinishReason.cancelled
        self.final_not_before = time.monotonic() + DURABLE_AFTER_S if held else 0.0
        choices = None
        if self.n > 1:
            choices = [
                Choice(
                    index=i,
                    text=self.sequence(i).text,
                    finish_reason=self.sequence(i).finish_reason or reason,
                    completion_tokens=len(self.sequence(i).token_ids),
                )
                for i in range(self.n)
            ]
        self.unpublished.append(
            Event(
                seq=self.next_seq,
                text=self.sequence(0).text,
                choices=choices,
                finish_reason=reason,
                usage=Usage(
                    prompt_tokens=len(self.prompt_token_ids),
                    completion_tokens=len(self.output_token_ids),
                    cached_tokens=self.cached_tokens,
                ),
                timings=self.timings.model_copy(),
                error=error,
                metadata=self.request.metadata if self.request is not None and metadata else None,
            )
        )
        self.set_final_status(
            reason,
            finished_at=self.timings.finished,
            completion_tokens=len(self.output_token_ids),
            error=error,
        )

    def set_final_status(
        self,
        reason: FinishReason,
        *,
        finished_at: float | None,
        completion_tokens: int | None,
        error: str | None,
    ) -> None:
        """Queue the terminal status fields (the one place they are written)."""
        self.set_status(
            state=FINAL_STATE[reason],
            finish_reason=reason,
            finished_at=finished_at,
            completion_tokens=completion_tokens,
            error=error,
        )

    def reject(self, error: str) -> None:
        """End as failed with ``error`` and a dead letter: bad input, poison, refused."""
        log.warning("job %s (entry %s) rejected: %s", self.job_id, self.delivery.entry_id, error)
        self.dead_letter = True
        self.set_status(queue=self.delivery.queue, entry=self.delivery.entry_id)
        self.end(FinishReason.error, error=error)

    def fail(self, stage: str, exc: BaseException) -> None:
        """End this job alone as failed (final error event, dead letter) after an error
        while handling it, whatever it was: the daemon and its other jobs go on.

        Events that cannot be encoded are cut from the outbox at the first one, so the
        stream stays gap-free; the final event carries no metadata (it may be the cause).
        """
        error = f"internal error while {stage}: {type(exc).__name__}: {exc}"
        log.error("job %s failed alone: %s", self.job_id, error, exc_info=exc)
        if self.ended and not any(event.final for event in self.unpublished):
            return  # its final event is stored already: the stream has its end
        kept: list[Event] = []
        for event in self.unpublished:
            if event.final or not _encodable(event):
                break
            kept.append(event)
        dropped = [e for e in self.unpublished[len(kept) :] if not e.final]
        self.unpublished = kept
        for event in reversed(dropped):
            progress = self.sequence(event.index or 0)
            progress.token_ids.pop()
            progress.text = progress.text[: len(progress.text) - len(event.text)]
            self.output_token_ids.pop()
        self.finish_reason = None
        self.dead_letter = True
        self.end(FinishReason.error, error=error, metadata=False)

    def leave_untouched(self) -> None:
        """Only this entry's dead letter and ack are written, never the named job's keys: a
        payload that did not parse cannot prove it is that job (it may be anyone's)."""
        log.warning(
            "job %s: entry %s did not parse and names a job that exists; that job is not "
            "touched, the entry is dead-lettered",
            self.job_id,
            self.delivery.entry_id,
        )
        self.unpublished.clear()
        self.status.clear()
        self.foreign = True

    def misfiled(self, error: str) -> None:
        """Rejected, and only this entry's dead letter and ack written: an entry added to
        a queue partition that is not its job id's names keys in another partition (on
        Redis Cluster, another slot), which the entry's scripts cannot reach."""
        self.reject(error)
        self.unpublished.clear()
        self.status.clear()
        self.foreign = True

    def resume_from(self, events: list[Event]) -> None:
        """Take the stored token events as already emitted (the checkpoint)."""
        for expected, event in enumerate(events):
            if event.seq != expected or event.token_id is None:
                raise ValueError(
                    f"job {self.job_id}: stored event {event.seq} at position {expected} "
                    "breaks the seq order"
                )
            if event.index is not None and event.index >= self.n:
                raise ValueError(
                    f"job {self.job_id}: stored event {event.seq} of sequence {event.index}, "
                    f"the job has n={self.n}"
                )
            self._take(event.index or 0, event.token_id, event.text)
        self.stored_events = len(events)


def _encodable(event: Event) -> bool:
    try:
        event.encode()
    except Exception:  # whatever the encoder refuses (a lone surrogate, a huge integer)
        return False
    return True
