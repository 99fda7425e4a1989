"""HeldJobs, the one owner of the jobs a daemon holds, without Redis: a fake engine's
outputs into outboxes, every engine finish reason named on the wire by the one table,
cancellation, a flush's confirmations, and the engine's capacity rule."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from batchd.daemon.worker.generator import FINISH_REASONS
from batchd.daemon.worker.held import HeldJobs
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.pickup import Pickup
from batchd.daemon.worker.publisher import FlushResult
from batchd.engine.config import EngineConfig
from batchd.engine.outputs import FinishReason as EngineFinish
from batchd.producers.schema import FinishReason, validate_job
from support.daemon_harness import FakeGenerator, token_output


def _job(job_id: str, **request: Any) -> Job:
    payload = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, **request}
    return Job(
        job_id,
        Delivery("default", f"{len(job_id)}-{sum(map(ord, job_id))}", {}),
        request=validate_job(payload),
        prompt_token_ids=[5, 6, 7],
    )


def _held(gen: FakeGenerator, **engine: int) -> tuple[HeldJobs, list[Job], list[Job]]:
    started: list[Job] = []
    finished: list[Job] = []
    held = HeldJobs(
        gen,
        engine=EngineConfig(**{"max_num_seqs": 4, **engine}),
        queue=2,
        on_started=started.append,
        on_finished=finished.append,
    )
    return held, started, finished


def test_the_table_names_every_engine_finish_reason_on_the_wire() -> None:
    assert set(FINISH_REASONS) == set(EngineFinish)
    assert {reason: FINISH_REASONS[reason] for reason in EngineFinish} == {
        EngineFinish.stop: FinishReason.stop,
        EngineFinish.length: FinishReason.length,
        EngineFinish.abort: FinishReason.cancelled,
        EngineFinish.error: FinishReason.error,
    }
    # Every wire reason comes from the table but expiry, which the daemon decides itself.
    assert set(FinishReason) - set(FINISH_REASONS.values()) == {FinishReason.expired}


@pytest.mark.parametrize("reason", list(EngineFinish))
def test_a_sequence_ended_by_the_engine_ends_its_job_with_the_wire_name(
    reason: EngineFinish,
) -> None:
    gen = FakeGenerator()
    held, started, _ = _held(gen)
    job = _job("j")
    assert held.admit(Pickup(run=[job])) == []
    assert started == [job] and gen.started == ["j"]
    error = "grammar failed" if reason is EngineFinish.error else None
    held.take([token_output("j", 9, "a", index=0)])
    held.take([token_output("j", 10, "b", index=1, finish=reason, error=error)])
    assert job.finish_reason is FINISH_REASONS[reason]
    # An error output carries no token: only the first one was published.
    assert job.output_token_ids == ([9] if error else [9, 10])
    assert job.unpublished[-1].final and job.error == error


def test_a_job_ends_with_the_last_of_its_sequences() -> None:
    gen = FakeGenerator()
    held, _, _ = _held(gen)
    job = _job("many", n=2)
    held.admit(Pickup(run=[job]))
    held.take([token_output("many", 3, "x", index=0, finish=EngineFinish.stop)])
    assert not job.ended
    out = token_output("many", 4, "y", index=0, finish=EngineFinish.length)
    held.take([dataclasses.replace(out, sample=1)])
    assert job.finish_reason is FinishReason.stop  # sequence 0's
    assert [c.finish_reason for c in job.unpublished[-1].choices or []] == [
        FinishReason.stop,
        FinishReason.length,
    ]


def test_cancel_aborts_only_what_the_engine_runs_and_room_counts_sequences() -> None:
    gen = FakeGenerator()
    held, _, finished = _held(gen)
    running, many = _job("run"), _job("many", n=3)
    held.admit(Pickup(run=[running, many]))
    assert held.room() == 4 + 2 - 4
    held.cancel(["run", "unknown"])
    assert gen.aborted == ["run"] and running.finish_reason is FinishReason.cancelled
    held.cancel(["run"])  # out of the engine already: nothing more
    assert gen.aborted == ["run"]
    # Its final event and status stored, its ack on the way: no longer counted then.
    running.unpublished.clear()
    running.status.clear()
    assert held.room(ending_now=True) == 4 + 2 - 3
    assert held.settle(FlushResult(finished=[running])) == []
    assert finished == [running] and list(held) == ["many"]
    assert held.stop_running() == [many] and gen.aborted == ["run", "many"]


def test_lost_and_reconciled_jobs_leave_the_engine() -> None:
    gen = FakeGenerator()
    held, _, _ = _held(gen)
    lost, again = _job("lost"), _job("again")
    held.admit(Pickup(run=[lost, again]))
    assert held.settle(FlushResult(lost=[lost], reconcile=[again])) == [again]
    assert not held and sorted(gen.aborted) == ["again", "lost"]


def test_a_suspect_runs_alone() -> None:
    """A suspect (batchd.daemon.fleet.poison) waits for an empty engine, is marked before
    it starts, and nothing starts beside it or behind it until it has ended."""
    gen = FakeGenerator()
    held, started, finished = _held(gen)
    marked: list[str] = []
    held.mark_alone = lambda job: marked.append(job.job_id) is None
    first, suspect, after = _job("first"), _job("suspect"), _job("after")
    suspect.alone = True
    held.admit(Pickup(run=[first, suspect, after]))
    assert started == [first] and marked == [] and held.room() == 0
    held.cancel(["first"])  # out of the engine, ended
    first.unpublished.clear()
    first.status.clear()
    held.settle(FlushResult(finished=[first]))
    assert started == [first, suspect] and marked == ["suspect"]
    held.start_waiting()
    assert started == [first, suspect]  # "after" waits while the suspect runs
    held.cancel(["suspect"])
    suspect.unpublished.clear()
    suspect.status.clear()
    held.settle(FlushResult(finished=[suspect]))
    assert started == [first, suspect, after] and finished == [first, suspect]
    assert held.room() > 0
