"""Which crashes count against a job (batchd.daemon.fleet.poison): only one while it ran
alone, started by an earlier delivery, with no event stored since."""

from __future__ import annotations

from batchd.daemon.fleet.poison import alone_crashes, suspect_after
from batchd.producers.schema import job_seed


def test_only_a_crash_while_alone_without_progress_counts() -> None:
    mark = {b"alone_delivery": b"3", b"alone_from": b"10", b"alone_crashes": b"0"}
    assert alone_crashes({}, deliveries=6, stored_events=0) == 0  # batch crashes: none
    assert alone_crashes(mark, deliveries=4, stored_events=10) == 1  # died alone, no progress
    assert alone_crashes(mark, deliveries=4, stored_events=12) == 0  # it made progress
    assert alone_crashes(mark, deliveries=3, stored_events=10) == 0  # same delivery read again
    counted = {**mark, b"alone_crashes": b"1"}
    assert alone_crashes(counted, deliveries=5, stored_events=10) == 2
    assert alone_crashes({b"alone_crashes": b"x"}, deliveries=2, stored_events=0) == 0


def test_a_job_runs_alone_after_two_crashes_in_its_batch() -> None:
    assert suspect_after(5) == 2 and suspect_after(1) == 1


def test_the_seed_of_an_unseeded_job_is_a_pure_function_of_its_id() -> None:
    assert job_seed("a") == job_seed("a") != job_seed("b")
    assert 0 <= job_seed("a") < 2**63
