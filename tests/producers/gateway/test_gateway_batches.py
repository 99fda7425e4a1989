"""The Batch API end to end with the official openai package: upload, create, a bulk
worker runs it on batchd's bulk machinery, output and error files come back."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from rq.registry import StartedJobRegistry

from batchd.producers.bulk import run_bulk, stage_run
from batchd.producers.bulk_files import FilesDir
from batchd.producers.bulk_worker import bulk_worker, rq_queue
from batchd.producers.gateway import batches
from batchd.producers.gateway.options import GatewayOptions
from support.daemon_harness import wait_until

MODEL = "tiny"


def batch_file(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def chat_line(custom_id: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def start_batch(oai: openai.OpenAI, tmp_path: Path, lines: list[dict[str, Any]]) -> Any:
    """Upload ``lines`` as a batch file and create a chat batch on it."""
    with batch_file(tmp_path / "in.jsonl", lines).open("rb") as source:
        upload = oai.files.create(file=source, purpose="batch")
    return oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def run_worker(gateway: Any) -> None:
    """One burst of `batchd bulk-worker --no-fork` on the gateway's files folder (in this
    thread: rq wants the main one)."""
    conn = redis.Redis.from_url(gateway.redis_url)
    assert bulk_worker(conn, files_dir=gateway.options.files_dir, burst=True, fork=False)


def test_batch_end_to_end(gateway: Any, oai: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(f"req-{i}", f"prompt {i}", max_tokens=5, temperature=0) for i in range(4)]
    lines.append(chat_line("bad", "x", best_of=3))
    lines.append(chat_line("two", "prompt 2", max_tokens=5, temperature=0, n=2))
    batch = start_batch(oai, tmp_path, lines)
    assert batch.status == "validating"
    run_worker(gateway)
    done = oai.batches.retrieve(batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (6, 5)
    assert done.request_counts.failed == 1
    assert done.output_file_id and done.error_file_id
    output = [orjson.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [*(f"req-{i}" for i in range(4)), "two"]
    two = output[4]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["message"] == two["choices"][1]["message"]  # greedy: equal
    assert two["choices"][0]["message"] == output[2]["response"]["body"]["choices"][0]["message"]
    assert two["usage"]["completion_tokens"] == 10
    online = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "prompt 2"}], max_tokens=5, temperature=0
    )
    body = output[2]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert body["usage"]["completion_tokens"] == 5
    errors = [orjson.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    refused = errors[0]["response"]
    assert errors[0]["custom_id"] == "bad" and refused["status_code"] == 400
    assert refused["body"]["error"]["param"] == "best_of"
    assert "best_of" in refused["body"]["error"]["message"]


def test_batch_cancelled_before_it_runs(gateway: Any, oai: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(f"c-{i}", "long", max_tokens=50) for i in range(3)]
    batch = start_batch(oai, tmp_path, lines)
    assert oai.batches.cancel(batch.id).status == "cancelling"
    run_worker(gateway)
    ended = oai.batches.retrieve(batch.id)
    assert ended.status == "cancelled" and ended.request_counts is not None
    assert (ended.request_counts.total, ended.request_counts.completed) == (3, 0)


def test_batchd_bulk_takes_an_openai_batch_file(gateway: Any, tmp_path: Path) -> None:
    source = batch_file(tmp_path / "in.jsonl", [chat_line("a", "hi", max_tokens=3)])
    out = tmp_path / "out.jsonl"
    conn = redis.Redis.from_url(gateway.redis_url)
    files = FilesDir.at(tmp_path / "files")
    run = stage_run(files, source, out)
    summary = run_bulk(run=run, files_dir=str(files.root), connection=conn)
    assert summary["done"] == 1 and summary["failed"] == 0
    record = orjson.loads(out.read_bytes())
    assert record["custom_id"] == "a" and record["finish_reason"] == "length"


def test_batch_resumes_after_its_worker_is_killed(
    gateway: Any, oai: openai.OpenAI, tmp_path: Path
) -> None:
    """SIGKILL the bulk worker mid-batch; rq retries the abandoned run, which reattaches
    to the jobs in flight: every request ends once, none is enqueued twice."""
    lines = [
        chat_line(f"k-{i}", f"resume {i}", max_tokens=4 if i == 0 else 1500, temperature=0)
        for i in range(8)
    ]
    conn = redis.Redis.from_url(gateway.redis_url)
    added = int(conn.xinfo_stream("batchd:queue:default")["entries-added"])
    batch = start_batch(oai, tmp_path, lines)
    command = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url", gateway.redis_url]
    folder = ["--files-dir", str(gateway.options.files_dir)]
    worker = subprocess.Popen([*command, "bulk-worker", "--burst", "--no-fork", *folder])

    def counts() -> Any:
        return oai.batches.retrieve(batch.id).request_counts

    wait_until(lambda: counts() is not None and counts().completed >= 1, timeout=60, what="1 done")
    worker.kill()
    worker.wait(10)
    assert counts().completed < 8, "the batch ended before the kill: make it longer"
    StartedJobRegistry(queue=rq_queue(conn)).cleanup(time.time() + 10**6)  # rq: abandoned
    run_worker(gateway)
    done = oai.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (8, 0)
    assert done.output_file_id is not None
    output = [orjson.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"k-{i}" for i in range(8)]
    assert int(conn.xinfo_stream("batchd:queue:default")["entries-added"]) - added == 8


def test_batch_past_its_window_expires(gateway: Any, oai: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(f"e-{i}", "late", max_tokens=5) for i in range(2)]
    batch = start_batch(oai, tmp_path, lines)
    conn = redis.Redis.from_url(gateway.redis_url)
    conn.hset(f"batchd:gateway:batch:{batch.id}", "expires_at", orjson.dumps(int(time.time()) - 1))
    run_worker(gateway)
    ended = oai.batches.retrieve(batch.id)
    assert ended.status == "expired" and ended.error_file_id is not None
    errors = [orjson.loads(x) for x in oai.files.content(ended.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("e-0", "batch_expired"),
        ("e-1", "batch_expired"),
    ]


def test_batches_list_newest_first(gateway: Any, oai: openai.OpenAI, tmp_path: Path) -> None:
    made = [start_batch(oai, tmp_path, [chat_line("l", "x", max_tokens=1)]).id for _ in range(3)]
    page = oai.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    assert [b.id for b in oai.batches.list(limit=1, after=made[1]).data] == [made[0]]
    for batch_id in made:  # leave nothing for the other tests' workers
        oai.batches.cancel(batch_id)


def test_files_and_batches_belong_to_their_key(
    gateway: Any, tmp_path: Path, start_gateway: Any
) -> None:
    options = GatewayOptions(api_keys=["sk-a", "sk-b"], files_dir=tmp_path)
    with start_gateway(gateway.redis_url, options) as gw:
        a, b = (
            openai.OpenAI(base_url=gw.base_url, api_key=k, max_retries=0) for k in options.api_keys
        )
        batch = start_batch(a, tmp_path, [chat_line("o", "x", max_tokens=1)])
        with pytest.raises(openai.NotFoundError):
            b.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            b.files.content(batch.input_file_id)
        assert b.batches.list().data == [] and [x.id for x in a.batches.list().data] == [batch.id]
        assert a.batches.cancel(batch.id).status == "cancelling"


def test_a_cancel_never_overwrites_an_end_the_run_wrote_after_its_read(gateway: Any) -> None:
    """The cancel reads the record, then writes ``cancelling`` only while the status is
    still not terminal: a run that finished between the two keeps ``completed`` (else the
    batch would wait for a worker that will never come back)."""
    conn = redis.Redis.from_url(gateway.redis_url)
    key = "batchd:gateway:batch:race-test"
    update = [b"status", orjson.dumps("cancelling"), b"cancelling_at", b"1"]
    for status, kept in (("completed", True), ("in_progress", False)):
        conn.hset(key, mapping={"status": orjson.dumps(status)})
        ended = conn.eval(batches._CANCEL, 1, key, *batches._TERMINAL_VALUES, *update)
        assert (ended == orjson.dumps(status)) is kept
        stored = orjson.loads(conn.hget(key, "status"))
        assert stored == (status if kept else "cancelling")
    conn.delete(key)


def test_the_files_api_refuses_what_it_cannot_do_in_openais_shape(
    gateway: Any, oai: openai.OpenAI
) -> None:
    """An upload must be a form (a JSON body is refused for its content type, not for a
    missing purpose), and listing files is a 400 that says it is not supported."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai.post("/files", body={"purpose": "batch"}, cast_to=object)
    assert caught.value.code == "unsupported_content_type"
    assert "multipart/form-data" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.files.list()
    assert caught.value.code == "unsupported_endpoint" and "listing files" in caught.value.message
