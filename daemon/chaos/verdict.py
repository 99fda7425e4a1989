"""The end of a chaos run: every job checked against the reference, one table, the zeros.

A job is judged by what its subscriber was given (what a client sees) and, while
its results have not expired, by what Redis stores: one final event, at the end
of a stream with no gap, holding the tokens the subscriber was given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from batchd.daemon.chaos.ledger import Ledger
from batchd.daemon.chaos.workload import CancelAt, ChaosJob
from batchd.producers.keys import EVENT_FIELD, Keys, seq_of
from batchd.producers.schema import Event, FinishReason

DONE = (FinishReason.stop, FinishReason.length)


@dataclass
class Verdict:
    submitted: int = 0
    resubmitted: int = 0
    completed: int = 0
    cancelled_as_asked: int = 0
    cancel_asked: int = 0
    hostile_sent: int = 0
    hostile_dead_lettered: int = 0
    lost: int = 0
    completed_twice: int = 0
    broken_streams: int = 0
    differing_greedy: int = 0
    differing_seeded: int = 0
    differing_unseeded: int = 0
    # Jobs not completed whose subscriber read tokens that are not a prefix of the
    # reference: two runs mixed in what a user read.
    mixed_runs: int = 0
    # Jobs whose stored end (its final event, while results are kept) is not the end their
    # subscriber read: e.g. a client read "length", Redis now says the job failed.
    stored_end_differs: int = 0
    wrong_answers: int = 0
    unexpected_dead_letters: int = 0
    unexpected_exits: int = 0
    renamed_after_expiry: int = 0  # ids a hostile entry took once the job's results expired
    findings: list[str] = field(default_factory=list)

    def zeros(self) -> dict[str, int]:
        """The counts that must be zero for the run to pass."""
        return {
            "lost": self.lost,
            "completed twice": self.completed_twice,
            "streams with gaps or duplicates": self.broken_streams,
            "outputs differing from the reference (greedy)": self.differing_greedy,
            "outputs differing from the reference (seeded)": self.differing_seeded,
            "outputs differing from the reference (unseeded)": self.differing_unseeded,
            "streams a subscriber read mixing two runs": self.mixed_runs,
            "stored ends differing from the end a subscriber read": self.stored_end_differs,
            "hostile entries not dead-lettered exactly once": (
                self.hostile_sent - self.hostile_dead_lettered
            ),
            "dead letters nobody sent": self.unexpected_dead_letters,
            "wrong answers to producers": self.wrong_answers,
            "daemon exits not caused by the test": self.unexpected_exits,
        }

    @property
    def passed(self) -> bool:
        return not any(self.zeros().values())


def judge(
    jobs: Sequence[ChaosJob],
    reference: dict[str, list[int]],
    ledger: Ledger,
    client: redis.Redis,
    keys: Keys,
    *,
    unexpected_exits: int,
) -> Verdict:
    verdict = Verdict(
        submitted=len(jobs),
        resubmitted=len(ledger.resubmitted),
        wrong_answers=len(ledger.wrong_answers),
        unexpected_exits=unexpected_exits,
    )
    verdict.findings += ledger.wrong_answers
    letters: list[Any] = []
    for dead in keys.dead_streams():
        letters += client.xrange(dead)  # type: ignore[arg-type]
    hostile_errors = _hostile_errors(ledger, letters)
    for job in jobs:
        _judge_job(verdict, job, reference[job.id], ledger, client, keys, hostile_errors)
    _judge_dead_letters(verdict, ledger, letters)
    return verdict


def _judge_job(
    verdict: Verdict,
    job: ChaosJob,
    expected: list[int],
    ledger: Ledger,
    client: redis.Redis,
    keys: Keys,
    hostile_errors: dict[str, set[str]],
) -> None:
    events = ledger.delivered.get(job.id, [])
    if job.id in ledger.gaps or not _unbroken(events):
        verdict.broken_streams += 1
        verdict.findings.append(f"{job.id}: delivered stream broken {ledger.gaps.get(job.id, '')}")
    tokens = _tokens(events)
    if not events or not events[-1].final or events[-1].finish_reason not in DONE:
        # Whatever it was given is one run: a prefix of the uninterrupted run's tokens.
        if tokens != expected[: len(tokens)]:
            verdict.mixed_runs += 1
            verdict.findings.append(
                f"{job.id}: read {tokens[:8]}... mixing runs; expected {expected[:8]}..."
            )
    if not events or not events[-1].final:
        verdict.lost += 1
        verdict.findings.append(f"{job.id}: no final event after {len(events)} event(s)")
        return
    final = events[-1]
    asked = job.cancel is not None and job.cancel is not CancelAt.finished
    verdict.cancel_asked += asked
    if final.finish_reason is FinishReason.cancelled and asked:
        right = tokens == expected[: len(tokens)]
        verdict.cancelled_as_asked += right
    else:
        right = final.finish_reason in DONE and tokens == expected
        verdict.completed += right
    if not right:
        if job.payload.get("seed") is not None:
            verdict.differing_seeded += 1
        elif job.payload.get("temperature", 0.0) > 0:
            verdict.differing_unseeded += 1
        else:
            verdict.differing_greedy += 1
        verdict.findings.append(
            f"{job.id}: {final.finish_reason} {final.error or ''} tokens {tokens[:8]}... "
            f"expected {expected[:8]}..."
        )
    _judge_stored(verdict, job.id, events, client.xrange(keys.events(job.id)), hostile_errors)


def _judge_stored(
    verdict: Verdict,
    job_id: str,
    delivered: list[Event],
    entries: Any,
    hostile_errors: dict[str, set[str]],
) -> None:
    """``entries``: the job's stored stream, as XRANGE gives it."""
    if not entries:
        return  # expired (or lost with Redis after the client had it all)
    stored = [Event.decode(fields[EVENT_FIELD.encode()]) for _, fields in entries]
    if _named_after_expiry(stored, job_id, hostile_errors):
        verdict.renamed_after_expiry += 1
        return
    if [seq_of(entry_id) for entry_id, _ in entries] != list(range(len(stored))) or not _unbroken(
        stored
    ):
        verdict.broken_streams += 1
        verdict.findings.append(f"{job_id}: stored stream broken")
    finals = sum(e.final for e in stored)
    if finals == 1 and stored[-1].finish_reason != delivered[-1].finish_reason:
        verdict.stored_end_differs += 1
        verdict.findings.append(
            f"{job_id}: stored end {stored[-1].finish_reason} {stored[-1].error or ''}; "
            f"its subscriber read {delivered[-1].finish_reason}"
        )
    if finals > 1 or (finals == 1 and _tokens(stored) != _tokens(delivered)):
        verdict.completed_twice += 1
        verdict.findings.append(
            f"{job_id}: stored {len(stored)} events with {finals} final(s) "
            f"({stored[-1].finish_reason}), tokens {_tokens(stored)}; delivered {len(delivered)} "
            f"({delivered[-1].finish_reason}), tokens {_tokens(delivered)}"
        )


def _named_after_expiry(stored: list[Event], job_id: str, hostile: dict[str, set[str]]) -> bool:
    """A hostile entry naming this job was handled after the job's keys were gone (its
    results expired while a fault held the entry, or a Redis crash lost them after its
    client had the final event): it is then a new job of that id, failed with its own
    error, which is what the stream holds. Not a second run."""
    return (
        len(stored) == 1
        and stored[0].finish_reason is FinishReason.error
        and stored[0].error in hostile.get(job_id, set())
    )


def _hostile_errors(ledger: Ledger, letters: list[Any]) -> dict[str, set[str]]:
    """Job id -> the errors its hostile entries were dead-lettered with."""
    sent = {send.entry_id for send in ledger.hostile}
    named: dict[str, set[str]] = {}
    for _, fields in letters:
        if fields.get(b"entry", b"").decode() in sent:
            job_id = fields.get(b"id", b"").decode(errors="replace")
            named.setdefault(job_id, set()).add(fields.get(b"error", b"").decode(errors="replace"))
    return named


def _unbroken(events: list[Event]) -> bool:
    return [e.seq for e in events] == list(range(len(events))) and not any(
        e.final for e in events[:-1]
    )


def _tokens(events: list[Event]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def _judge_dead_letters(verdict: Verdict, ledger: Ledger, letters: list[Any]) -> None:
    per_entry = Counter(fields.get(b"entry", b"").decode() for _, fields in letters)
    sent = {send.entry_id for send in ledger.hostile}
    verdict.hostile_sent = len(sent)
    verdict.hostile_dead_lettered = sum(1 for entry in sent if per_entry[entry] == 1)
    for entry in sent:
        if per_entry[entry] != 1:
            verdict.findings.append(f"hostile entry {entry} dead-lettered {per_entry[entry]} times")
    for entry in ledger.hostile_lost:
        if per_entry[entry] > 1:
            verdict.findings.append(f"lost hostile entry {entry} dead-lettered {per_entry[entry]}x")
            verdict.unexpected_dead_letters += per_entry[entry] - 1
    known = sent | ledger.hostile_lost
    strangers = sum(count for entry, count in per_entry.items() if entry not in known)
    verdict.unexpected_dead_letters += max(0, strangers - ledger.hostile_unanswered)
    if verdict.unexpected_dead_letters:
        verdict.findings.append(f"{strangers} dead letters of entries nobody sent as hostile")
