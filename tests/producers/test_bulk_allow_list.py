"""The bulk worker runs batchd's bulk functions only: a job naming any other is refused
before rq imports it, and fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from rq.job import JobStatus

from producers.bulk_worker import bulk_worker, rq_queue
from support.redis_server import RedisServer


@pytest.mark.parametrize("fork", [False, True], ids=["simple", "forking"])
def test_a_foreign_function_is_refused_and_never_runs(
    redis_server: RedisServer, tmp_path: Path, fork: bool
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me")
    stolen = tmp_path / "stolen.txt"
    conn = redis_server.client()
    job = rq_queue(conn).enqueue_call("shutil.copyfile", args=[str(secret), str(stolen)])

    assert bulk_worker(conn, burst=True, fork=fork)

    assert not stolen.exists()
    job.refresh()
    assert job.get_status() == JobStatus.FAILED
    result = job.latest_result()
    assert result is not None and "refused: 'shutil.copyfile'" in str(result.exc_string)
