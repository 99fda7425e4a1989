"""The bulk worker runs batchd's bulk functions only: a job naming any other is refused
before rq imports it, and fails (more attacks: tests/security/test_rq_boundary.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rq import Callback, Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from batchd.producers.bulk_worker import bulk_worker, rq_queue
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

    assert bulk_worker(conn, files_dir=tmp_path / "files", burst=True, fork=fork)

    assert not stolen.exists()
    job.refresh()
    assert job.get_status() == JobStatus.FAILED
    result = job.latest_result()
    assert result is not None and "refused: 'shutil.copyfile'" in str(result.exc_string)


@pytest.mark.parametrize("fork", [False, True], ids=["simple", "forking"])
def test_callbacks_named_in_redis_are_never_imported(
    redis_server: RedisServer, tmp_path: Path, fork: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    imported, called = tmp_path / "imported.txt", tmp_path / "called.txt"
    (tmp_path / "evil_callback.py").write_text(
        f"open({str(imported)!r}, 'w').write('x')\n"
        f"def run(*args, **kwargs):\n    open({str(called)!r}, 'w').write('x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    conn = redis_server.client()
    evil = Callback("evil_callback.run")
    job = Queue("batchd-bulk", connection=conn, serializer=JSONSerializer).enqueue_call(
        "batchd.producers.bulk.run_bulk",
        kwargs={"run": "missing"},
        on_success=evil,
        on_failure=evil,
        on_stopped=evil,
    )

    assert bulk_worker(conn, files_dir=tmp_path / "files", burst=True, fork=fork)

    job.refresh()
    assert job.get_status() == JobStatus.FAILED  # refused: it names callbacks
    assert not imported.exists() and not called.exists()
    assert "evil_callback" not in sys.modules
