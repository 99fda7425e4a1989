"""Bulk runs on rq: bounded window, one result per line, resume after a killed worker."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import orjson
import pytest
import redis
from rq import SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchd.daemon.cli import main
from batchd.producers.bulk import ResultFile, line_job_id, parse_line, run_bulk
from batchd.producers.bulk_worker import rq_queue
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
    argv = ["--redis-url", redis_server.url, "bulk", str(source), "--out", str(out)]
    with text_daemon(redis_server.url, token_delay_s=0.02, max_active=64) as daemon:
        assert main([*argv, "--window", "16"]) == 0
        # No fork: SIGKILL takes the run down with the worker (a forked horse would
        # live on, holding the output's lock).
        worker = start_worker(redis_server, "--no-fork")
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
        second = start_worker(redis_server)
        assert second.wait(timeout=60) == 0, second.stderr.read() if second.stderr else ""

    job = Job.fetch(rerun_id, connection=redis_server.client(), serializer=JSONSerializer)
    assert job.get_status() is JobStatus.FINISHED, getattr(job.latest_result(), "exc_string", "")
    results = read_output(out)
    assert sorted(r["line"] for r in results) == list(range(1, 201))
    for record in results:
        n = record["line"]
        assert record["text"] == expected_text(f"line {n}", 10), record
        assert record["id"] == line_job_id(
            source, n, json.dumps({"prompt": f"line {n}", "max_tokens": 10})
        )
    assert len(daemon.started) == 200 and set(daemon.started.values()) == {1}  # none ran twice
    assert 1 < daemon.max_active <= 16
    progress = job.get_meta()["progress"]
    assert (job.get_status(), progress["total"], progress["done"]) == (JobStatus.FINISHED, 200, 200)
    assert progress["failed"] == 0 and progress["tokens"] > 0


def test_bulk_bad_lines_and_failed_jobs(redis_server: RedisServer, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"prompt": "ok", "max_tokens": 3}\n'
        "\n"
        "not json\n"
        '{"prompt": "x", "temperature": -1}\n'
        '{"prompt": "!fail", "max_tokens": 3}\n'
        '{"prompt": "fine", "max_tokens": 2, "metadata": {"row": 6}}\n'
    )
    out = tmp_path / "out.jsonl"
    with text_daemon(redis_server.url):
        summary = run_bulk(
            input_path=str(source), output_path=str(out), window=2, connection=redis_server.client()
        )
    by_line = {r["line"]: r for r in read_output(out)}
    assert sorted(by_line) == [1, 3, 4, 5, 6]
    assert by_line[1]["text"] == "okokok"[:3] and by_line[1]["finish_reason"] == "length"
    assert "line: invalid JSON" in by_line[3]["error"]
    assert by_line[4]["error"].startswith("temperature:")
    assert "fake failure" in by_line[5]["error"] and by_line[5]["reason"] == "error"
    assert by_line[6]["metadata"] == {"row": 6}
    assert (summary["total"], summary["done"], summary["failed"]) == (5, 5, 3)


def test_rq_worker_runs_bulk_and_progress_is_shown(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_input(tmp_path / "in.jsonl", 10, max_tokens=2)
    out = tmp_path / "out.jsonl"
    conn = redis_server.client()
    assert main(["--redis-url", redis_server.url, "bulk", str(source), "--out", str(out)]) == 0
    job_id = capsys.readouterr().out.strip()
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert job.kwargs["input_path"] == str(source) and job.timeout == -1
    stored = json.loads(zlib.decompress(conn.hget(job.key, "data") or b""))  # JSON, not pickle
    assert stored[0] == "batchd.producers.bulk.run_bulk" and stored[3]["window"] == 64
    with text_daemon(redis_server.url):
        SimpleWorker([rq_queue(conn)], connection=conn, serializer=JSONSerializer).work(burst=True)
    bar = io.StringIO()
    assert follow_progress(conn, job_id, stream=bar, poll_s=0.01) is JobStatus.FINISHED
    assert f"[{'#' * 30}] 10/10 lines, 0 failed" in bar.getvalue()
    assert len(read_output(out)) == 10


def test_result_file_resumes_and_locks(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"line": 1}\n{"line": 4}\n{"line": 7, "te')  # torn by a crash
    with ResultFile(out) as results:
        assert results.done == {1, 4}
        with pytest.raises(BulkBusy):
            ResultFile(out)
        results.write({"line": 7})
    assert out.read_bytes() == b'{"line": 1}\n{"line": 4}\n{"line":7}\n'


def test_line_parsing_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    job, _ = parse_line('{"prompt": "a"}', input_path=path, line_no=3)
    assert job.id == line_job_id(path, 3, '{"prompt": "a"}') and job.id.startswith("bulk-3-")
    assert line_job_id(path, 3, "x") != line_job_id(path, 4, "x") != line_job_id(path, 4, "y")
    assert parse_line('{"prompt": "a", "id": "mine"}', input_path=path, line_no=1)[0].id == "mine"
    with pytest.raises(ValidationError, match="expected a JSON object"):
        parse_line("[1]", input_path=path, line_no=1)


def test_bulk_command_rejects_bad_input(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--redis-url", redis_server.url, "bulk"]
    assert main([*base, str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a file" in capsys.readouterr().err
    source = write_input(tmp_path / "in.jsonl", 1, max_tokens=1)
    assert main([*base, str(source), "--out", str(tmp_path / "o"), "--window", "0"]) == 2
    assert "window: must be at least 1" in capsys.readouterr().err
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
    out = tmp_path / "out.jsonl"
    with text_daemon(redis_server.url):
        run_bulk(input_path=str(source), output_path=str(out), connection=redis_server.client())
        by_line = {r["line"]: r for r in read_output(out)}
        assert by_line[1]["id"] == "same" and by_line[1]["text"] == "fi"
        assert by_line[3]["error"] == "id: repeats the id of line 1"
        assert by_line[3]["field"] == "id"
        # A resumed run knows line 1's id from OUT.
        kept = [r for r in read_output(out) if r["line"] != 3]
        out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))
        run_bulk(input_path=str(source), output_path=str(out), connection=redis_server.client())
    assert {r["line"]: r for r in read_output(out)}[3]["error"] == "id: repeats the id of line 1"
