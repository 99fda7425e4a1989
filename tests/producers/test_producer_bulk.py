"""Bulk runs on rq: bounded window, one result per line, resume after a killed worker."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest
import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchd.daemon.cli import main
from batchd.producers.bulk import line_job_id, parse_line, run_bulk, run_name, stage_run
from batchd.producers.bulk_files import FilesDir, ResultFile
from batchd.producers.bulk_worker import BulkSimpleWorker, rq_queue
from batchd.producers.commands.bulk import follow_progress
from batchd.producers.errors import BulkBusy, ValidationError
from support.redis_server import RedisServer
from support.text_daemon import expected_text, text_daemon

ROOT = Path(__file__).resolve().parents[2]


def write_input(path: Path, count: int, max_tokens: int) -> Path:
    lines = [
        json.dumps({"prompt": f"line {n}", "max_tokens": max_tokens}) for n in range(1, count + 1)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_output(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def run_in_process(
    redis_server: RedisServer, tmp_path: Path, source: Path, **options: object
) -> tuple[dict, Path]:
    """``run_bulk`` of IN in this process (no rq): its summary, and OUT (a link to the
    run's output in the files folder ``tmp_path/files``)."""
    files = FilesDir.at(tmp_path / "files")
    out = tmp_path / "out.jsonl"
    run = stage_run(files, source, out)
    summary = run_bulk(
        run=run, files_dir=str(files.root), connection=redis_server.client(), **options
    )
    return summary, out


def start_worker(server: RedisServer, *options: str) -> subprocess.Popen[bytes]:
    """``batchd bulk-worker --burst`` in a subprocess."""
    command = ["-m", "batchd.daemon.cli", "--redis-url", server.url, "bulk-worker", "--burst"]
    return subprocess.Popen(
        [sys.executable, *command, *options],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_bulk_window_and_resume_after_worker_kill(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_input(tmp_path / "in.jsonl", 200, max_tokens=10)
    out = tmp_path / "out.jsonl"
    files = ["--files-dir", str(tmp_path / "files")]
    argv = ["--redis-url", redis_server.url, "bulk", str(source), "--out", str(out), *files]
    with text_daemon(redis_server.url, token_delay_s=0.02, max_active=64) as daemon:
        assert main([*argv, "--window", "16"]) == 0
        # No fork: SIGKILL takes the run down with the worker (a forked horse would
        # live on, holding the output's lock).
        worker = start_worker(redis_server, "--no-fork", *files)
        deadline = time.monotonic() + 30
        while not out.exists() or len(out.read_bytes().splitlines()) < 60:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.02)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        done_first = len(read_output(out))
        assert 60 <= done_first < 200

        assert main([*argv, "--window", "16"]) == 0
        rerun_id = capsys.readouterr().out.split()[-1]
        second = start_worker(redis_server, *files)
        assert second.wait(timeout=60) == 0, second.stderr.read() if second.stderr else ""

    job = Job.fetch(rerun_id, connection=redis_server.client(), serializer=JSONSerializer)
    assert job.get_status() is JobStatus.FINISHED, getattr(job.latest_result(), "exc_string", "")
    results = read_output(out)
    assert sorted(r["line"] for r in results) == list(range(1, 201))
    for record in results:
        n = record["line"]
        assert record["text"] == expected_text(f"line {n}", 10), record
        assert record["id"] == line_job_id(
            run_name(source, out), n, json.dumps({"prompt": f"line {n}", "max_tokens": 10})
        )
    assert len(daemon.started) == 200 and set(daemon.started.values()) == {1}  # none ran twice
    assert 1 < daemon.max_active <= 16
    progress = job.get_meta()["progress"]
    assert (job.get_status(), progress["total"], progress["done"]) == (JobStatus.FINISHED, 200, 200)
    assert progress["failed"] == 0 and progress["tokens"] > 0


def test_bulk_bad_lines_and_failed_jobs(redis_server: RedisServer, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b'{"prompt": "ok", "max_tokens": 3}\n'
        b"\n"
        b"not json\n"
        b'{"prompt": "x", "temperature": -1}\n'
        b'{"prompt": "!fail", "max_tokens": 3}\n'
        b'{"prompt": "fine", "max_tokens": 2, "metadata": {"row": 6}}\n'
        b'{"prompt": "\xff\xfe"}\n'
    )
    with text_daemon(redis_server.url):
        summary, out = run_in_process(redis_server, tmp_path, source, window=2)
    by_line = {r["line"]: r for r in read_output(out)}
    assert sorted(by_line) == [1, 3, 4, 5, 6, 7]
    assert by_line[1]["text"] == "okokok"[:3] and by_line[1]["finish_reason"] == "length"
    assert "line: invalid JSON" in by_line[3]["error"]
    assert by_line[4]["error"].startswith("temperature:")
    assert "fake failure" in by_line[5]["error"] and by_line[5]["reason"] == "error"
    assert by_line[6]["metadata"] == {"row": 6}
    assert by_line[7]["error"] == "line: not UTF-8 (byte 12)"  # one bad line, not the run
    assert (summary["total"], summary["done"], summary["failed"]) == (6, 6, 4)


def test_rq_worker_runs_bulk_and_progress_is_shown(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_input(tmp_path / "in.jsonl", 10, max_tokens=2)
    out = tmp_path / "out.jsonl"
    conn = redis_server.client()
    argv = ["--redis-url", redis_server.url, "bulk", str(source), "--out", str(out)]
    assert main([*argv, "--files-dir", str(tmp_path / "files")]) == 0
    job_id = capsys.readouterr().out.strip()
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    # The job names its run, no path; the worker's folder holds its files.
    assert job.kwargs["run"] == run_name(source, out) and job.timeout == -1
    assert "input_path" not in job.kwargs and "files_dir" not in job.kwargs
    stored = json.loads(zlib.decompress(conn.hget(job.key, "data") or b""))  # JSON, not pickle
    assert stored[0] == "batchd.producers.bulk.run_bulk" and stored[3]["window"] == 64
    assert out.is_symlink() and out.resolve().parent == (tmp_path / "files").resolve()
    bar = io.StringIO()
    with ThreadPoolExecutor(1) as pool:
        following = pool.submit(
            follow_progress, redis_server.client(), job_id, stream=bar, poll_s=0.01
        )
        deadline = time.monotonic() + 30
        while "queued: waiting for a bulk worker" not in bar.getvalue():
            assert time.monotonic() < deadline, bar.getvalue()  # what the run waits for
            time.sleep(0.01)
        with text_daemon(redis_server.url):
            worker = BulkSimpleWorker([rq_queue(conn)], connection=conn, serializer=JSONSerializer)
            worker.files_dir = (tmp_path / "files").resolve()
            worker.work(burst=True)
        assert following.result(timeout=60) is JobStatus.FINISHED
    drawn = bar.getvalue().split("\r")[1:]
    assert drawn[-1].startswith(f"[{'#' * 30}] 10/10 lines, 0 failed")
    # Each line covers the longer one before it: no tail of the waiting message is left.
    assert all(len(b) >= len(a) for a, b in zip(drawn, drawn[1:], strict=False))
    assert len(read_output(out)) == 10


def test_result_file_resumes_and_locks(tmp_path: Path) -> None:
    files = FilesDir.at(tmp_path)
    with ResultFile(files, "out.jsonl", run="r") as results:  # created: owner-marked
        results.write({"line": 1})
        results.write({"line": 4})
    out = tmp_path / "out.jsonl"
    with out.open("ab") as torn:
        torn.write(b'{"line": 7, "te')  # torn by a crash
    with ResultFile(files, "out.jsonl", run="r") as results:
        assert results.done == {1, 4}
        with pytest.raises(BulkBusy):
            ResultFile(files, "out.jsonl", run="r")
        results.write({"line": 7})
    assert out.read_bytes() == b'{"line":1}\n{"line":4}\n{"line":7}\n'


def test_line_parsing_and_ids() -> None:
    job, _ = parse_line('{"prompt": "a"}', run="r", line_no=3)
    assert job.id == line_job_id("r", 3, '{"prompt": "a"}') and job.id.startswith("bulk-3-")
    assert line_job_id("r", 3, "x") != line_job_id("r", 4, "x") != line_job_id("r", 4, "y")
    assert line_job_id("r", 3, "x") != line_job_id("s", 3, "x")
    assert parse_line('{"prompt": "a", "id": "mine"}', run="r", line_no=1)[0].id == "mine"
    with pytest.raises(ValidationError, match="expected a JSON object"):
        parse_line("[1]", run="r", line_no=1)


def test_bulk_command_rejects_bad_input(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--redis-url", redis_server.url, "bulk", "--files-dir", str(tmp_path / "files")]
    assert main([*base, str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a file" in capsys.readouterr().err
    source = write_input(tmp_path / "in.jsonl", 1, max_tokens=1)
    assert main([*base, str(source), "--out", str(tmp_path / "o"), "--window", "0"]) == 2
    assert "window: must be at least 1" in capsys.readouterr().err
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    assert main([*base, str(source), "--out", str(taken)]) == 2  # OUT is never overwritten
    assert "exists and is not this run's output" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"
    assert redis.Redis.from_url(redis_server.url).llen("rq:queue:batchd-bulk") == 0


def test_bulk_refuses_a_repeated_id(redis_server: RedisServer, tmp_path: Path) -> None:
    """Two lines naming the same id would share one result: the second is an error line,
    also when the run resumes after the first was written."""
    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"id": "same", "prompt": "first", "max_tokens": 2}\n'
        '{"id": "other", "prompt": "ok", "max_tokens": 2}\n'
        '{"id": "same", "prompt": "second", "max_tokens": 2}\n'
    )
    with text_daemon(redis_server.url):
        _, out = run_in_process(redis_server, tmp_path, source)
        by_line = {r["line"]: r for r in read_output(out)}
        assert by_line[1]["id"] == "same" and by_line[1]["text"] == "fi"
        assert by_line[3]["error"] == "id: repeats the id of line 1"
        assert by_line[3]["field"] == "id"
        # A resumed run knows line 1's id from OUT.
        kept = [r for r in read_output(out) if r["line"] != 3]
        out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))  # through OUT's link
        run_in_process(redis_server, tmp_path, source)
    assert {r["line"]: r for r in read_output(out)}[3]["error"] == "id: repeats the id of line 1"
