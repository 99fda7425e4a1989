"""rq can never touch a file it was not given, nor run or fetch what a job names
(security findings 2 and 3), tried for real: jobs written as an attacker with write
access to Redis would (rq's plain Queue, or raw hashes), a real redis-server and real
rq workers (in-process and forking).

Before the fix: run_bulk took any path (its torn-line repair emptied a token file
without a trailing newline, cut an ini file's last line, and appended to any file), a
refused job still fired its webhook (a request with an injected header to any URL),
and registry maintenance imported and ran an abandoned job's failure callback (rq
loaded it with its plain Job class).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Callback, Queue, Repeat, Worker
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from batchd.producers.bulk_files import OWNER_SUFFIX, FilesDir, ResultFile
from batchd.producers.bulk_worker import bulk_worker, rq_queue
from batchd.producers.errors import UnsafePath
from support.redis_server import RedisServer

TOKEN = b"ghp_0123456789abcdefNOEOL"  # a token file with no trailing newline
INI = b"[core]\nuser = me\nlast = line-without-newline"


class Listener:
    """An HTTP server on 127.0.0.1 that the test owns; it records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                seen.append((self.command, self.path, dict(self.headers)))
                self.send_response(200)
                self.end_headers()

            do_GET = do_POST = _record

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A module on sys.path that leaves a file behind if it is ever imported or called."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "planted_hook.py").write_text(
        f"open({str(marks / 'imported')!r}, 'w').write('x')\n"
        f"def run(*args, **kwargs):\n    open({str(marks / 'called')!r}, 'w').write('x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marks
    sys.modules.pop("planted_hook", None)


def attacker_queue(conn: redis.Redis) -> Queue:
    """rq's own Queue on batchd's queue name: what anyone with Redis write access has."""
    return Queue("batchd-bulk", connection=conn, serializer=JSONSerializer)


def outside_files(tmp_path: Path) -> tuple[Path, Path]:
    token, ini = tmp_path / "token", tmp_path / "settings.ini"
    token.write_bytes(TOKEN)
    ini.write_bytes(INI)
    return token, ini


def work(conn: redis.Redis, folder: Path, *, fork: bool = False) -> None:
    assert bulk_worker(conn, files_dir=folder, burst=True, fork=fork)


def failure(job: Job) -> str:
    job.refresh()
    assert job.get_status() == JobStatus.FAILED
    result = job.latest_result()
    return str(result.exc_string if result else "")


@pytest.mark.parametrize("fork", [False, True], ids=["simple", "forking"])
def test_jobs_naming_paths_touch_nothing(
    redis_server: RedisServer, tmp_path: Path, fork: bool
) -> None:
    token, ini = outside_files(tmp_path)
    folder = tmp_path / "files"
    FilesDir.at(folder)
    conn = redis_server.client()
    q = attacker_queue(conn)
    jobs = [
        # The old signature: any input and output path.
        q.enqueue_call(
            "batchd.producers.bulk.run_bulk",
            kwargs={"input_path": str(ini), "output_path": str(token)},
        ),
        # The run's own name climbing out of the folder.
        q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": f"../{token.name}"}),
        q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": str(token)}),
        # A folder of the job's choosing.
        q.enqueue_call(
            "batchd.producers.bulk.run_bulk", kwargs={"run": "r1", "files_dir": str(tmp_path)}
        ),
        q.enqueue_call(
            "batchd.producers.gateway.batch_run.run_batch",
            kwargs={"batch_id": "../../token", "queue": "default", "prefix": "batchd", "window": 1},
        ),
        q.enqueue_call("batchd.producers.bulk.run_bulk", args=[str(token)], kwargs={"run": "r2"}),
    ]
    (tmp_path / "r1.input.jsonl").write_bytes(b'{"prompt": "x"}\n')  # not in its folder
    work(conn, folder, fork=fork)
    for job in jobs:
        failure(job)
    assert token.read_bytes() == TOKEN and ini.read_bytes() == INI
    assert not (tmp_path / "r1.output.jsonl").exists()


def test_links_and_foreign_files_in_the_folder_are_refused(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    token, ini = outside_files(tmp_path)
    folder = tmp_path / "files"
    files = FilesDir.at(folder)
    (folder / "a.input.jsonl").write_bytes(b'{"prompt": "x"}\n')
    (folder / "a.output.jsonl").symlink_to(token)  # planted link to a file outside
    (folder / "b.input.jsonl").symlink_to(ini)  # input read through a link
    (folder / "c.input.jsonl").write_bytes(b'{"prompt": "x"}\n')
    (folder / "c.output.jsonl").write_bytes(INI)  # a file batchd did not create
    conn = redis_server.client()
    q = rq_queue(conn)
    jobs = [q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": r}) for r in "abc"]
    work(conn, folder)
    reasons = [failure(job) for job in jobs]
    assert all("UnsafePath" in reason for reason in reasons), reasons
    assert token.read_bytes() == TOKEN and ini.read_bytes() == INI
    assert (folder / "c.output.jsonl").read_bytes() == INI
    with pytest.raises(UnsafePath):
        ResultFile(files, "c.output.jsonl", run="c")
    # An owner mark copied from another run does not make a file this run's.
    with ResultFile(files, "d.output.jsonl", run="d") as out:
        out.write({"line": 1})
    (folder / f"e.output.jsonl{OWNER_SUFFIX}").write_bytes(
        (folder / f"d.output.jsonl{OWNER_SUFFIX}").read_bytes()
    )
    (folder / "e.output.jsonl").write_bytes(b'{"line": 1}\n{"torn')
    with pytest.raises(UnsafePath):
        ResultFile(files, "e.output.jsonl", run="e")
    assert (folder / "e.output.jsonl").read_bytes() == b'{"line": 1}\n{"torn'


@pytest.mark.parametrize("fork", [False, True], ids=["simple", "forking"])
def test_webhooks_and_callbacks_of_any_job_never_fire(
    redis_server: RedisServer, tmp_path: Path, listener: Listener, planted: Path, fork: bool
) -> None:
    conn = redis_server.client()
    q = attacker_queue(conn)
    hooks = [
        Webhook(listener.url, status, method=method, headers={"X-Injected": "1"})
        for status in ("failed", "finished")
        for method in ("GET", "POST")
    ]
    evil = Callback("planted_hook.run")
    options: dict[str, Any] = {
        "webhooks": hooks,
        "on_success": evil,
        "on_failure": evil,
        "on_stopped": evil,
    }
    refused = q.enqueue_call("os.system", args=["true"], **options)
    allowed = q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": "x"}, **options)
    work(conn, tmp_path / "files", fork=fork)
    assert "refused: 'os.system'" in failure(refused)
    assert "names on_success, on_failure, on_stopped, webhooks" in failure(allowed)
    time.sleep(0.2)  # a webhook is sent synchronously; give a stray one time to land
    assert listener.requests == []
    assert not list(planted.iterdir()) and "planted_hook" not in sys.modules


def test_abandoned_jobs_callbacks_and_webhooks_never_fire(
    redis_server: RedisServer, tmp_path: Path, listener: Listener, planted: Path
) -> None:
    """rq's registry maintenance fails an abandoned job (its worker died): it must not
    import the failure callback nor send the webhook the job names."""
    conn = redis_server.client()
    q = attacker_queue(conn)
    jobs = []
    for n in range(2):
        job = q.enqueue_call(
            "batchd.producers.bulk.run_bulk",
            kwargs={"run": f"gone-{n}"},
            on_failure=Callback("planted_hook.run"),
            webhooks=[Webhook(listener.url, "failed", headers={"X-Injected": "1"})],
        )
        # What a worker that died mid-job leaves: the job started, its execution expired.
        q.remove(job)
        job.set_status(JobStatus.STARTED)
        conn.zadd(StartedJobRegistry(queue=q).key, {f"{job.id}:dead-execution": 1})
        jobs.append(job)
    # Maintenance through batchd's queue object, and through the worker's own pass.
    StartedJobRegistry(queue=rq_queue(conn), job_class=rq_queue(conn).job_class).cleanup()
    conn.zadd(StartedJobRegistry(queue=q).key, {f"{jobs[1].id}:dead-execution": 1})
    jobs[1].set_status(JobStatus.STARTED)
    worker = Worker([rq_queue(conn)], connection=conn, serializer=JSONSerializer)
    worker.clean_registries()
    bulk_worker(conn, files_dir=tmp_path / "files", burst=True, fork=False)
    time.sleep(0.2)
    assert listener.requests == []
    assert not list(planted.iterdir()) and "planted_hook" not in sys.modules


def test_dependencies_and_repeats_are_refused(redis_server: RedisServer, tmp_path: Path) -> None:
    conn = redis_server.client()
    q = attacker_queue(conn)
    done = q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": "done"})
    q.remove(done)
    done.set_status(JobStatus.FINISHED)  # a dependency met: its dependent is queued at once
    dependent = q.enqueue_call(
        "batchd.producers.bulk.run_bulk", kwargs={"run": "dep"}, depends_on=done
    )
    pending = q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": "pending"})
    deferred = q.enqueue_call(
        "batchd.producers.bulk.run_bulk", kwargs={"run": "deferred"}, depends_on=pending
    )
    repeated = q.enqueue_call(
        "batchd.producers.bulk.run_bulk", kwargs={"run": "rep"}, repeat=Repeat(times=3)
    )
    assert bulk_worker(conn, files_dir=tmp_path / "files", burst=True, fork=False)
    assert "names depends_on" in failure(dependent)
    assert "names repeat" in failure(repeated)
    assert "No such file" in failure(pending)  # its own run, which had no input
    deferred.refresh()  # never released: its dependency ids are never read
    assert deferred.get_status() == JobStatus.DEFERRED
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == []


def test_the_bulk_queue_refuses_them_at_enqueue(redis_server: RedisServer, tmp_path: Path) -> None:
    q = rq_queue(redis_server.client())
    options: list[dict[str, Any]] = [
        {"on_success": Callback("planted_hook.run")},
        {"on_failure": Callback("planted_hook.run")},
        {"webhooks": [Webhook("http://127.0.0.1:9/x", "finished")]},
        {"depends_on": "some-job"},
        {"repeat": Repeat(times=2)},
    ]
    for option in options:
        with pytest.raises(ValueError, match="the bulk queue refuses"):
            q.enqueue_call("batchd.producers.bulk.run_bulk", kwargs={"run": "x"}, **option)
    assert q.count == 0
