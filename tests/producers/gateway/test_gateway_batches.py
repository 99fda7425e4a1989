"""The Batch API end to end with the official openai package: upload, create, a bulk
worker runs it on batchd's bulk machinery, output and error files come back."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from rq.job import JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from batchd.producers.bulk import ABANDONED_RETRIES, run_bulk, stage_run
from batchd.producers.bulk_files import FilesDir
from batchd.producers.bulk_worker import SafeJob, bulk_worker, rq_queue
from batchd.producers.gateway import batches
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.store import key_id
from support.daemon_harness import wait_until

API_KEY = "sk-test-gateway"  # the module gateway's (conftest.API_KEY)

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
    missing purpose) of purpose ``batch`` (the only one batchd serves)."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai.post("/files", body={"purpose": "batch"}, cast_to=object)
    assert caught.value.code == "unsupported_content_type"
    assert "multipart/form-data" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "purpose"


FILE_FIELDS = {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status"}
BATCH_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")
BATCH_FIELDS = {
    *("id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status"),
    *("output_file_id", "error_file_id", "created_at", "expires_at", "request_counts"),
    *(*BATCH_TIMES, "cancelling_at", "cancelled_at", "metadata"),
}


def http(gateway: Any, key: str = API_KEY) -> httpx.Client:
    """Raw HTTP on the gateway: what a client other than the SDK reads (every field)."""
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=gateway.base_url, headers=headers, timeout=30)


def test_file_and_batch_objects_carry_every_field_openai_answers(gateway: Any) -> None:
    """A batch object names all its timestamps from the start (null until reached), as
    OpenAI's does; a file's bytes come back exactly as uploaded; delete answers OpenAI's
    deletion object. Before the fix a new batch had no ``in_progress_at``...``cancelled_at``
    keys at all (raw clients that index them failed)."""
    data = orjson.dumps(chat_line("f", "exact bytes", max_tokens=2)) + b"\r\n\n"
    with http(gateway) as client:
        upload = client.post(
            "/files", files={"file": ("mine.jsonl", data)}, data={"purpose": "batch"}
        ).json()
        assert set(upload) == FILE_FIELDS, upload
        assert (upload["object"], upload["bytes"], upload["filename"]) == (
            "file",
            len(data),
            "mine.jsonl",
        )
        assert upload["purpose"] == "batch" and upload["expires_at"] > upload["created_at"]
        assert client.get(f"/files/{upload['id']}").json() == upload
        assert client.get(f"/files/{upload['id']}/content").content == data
        body = {
            "input_file_id": upload["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        made = client.post("/batches", json=body).json()
        assert set(made) - {"notice"} == BATCH_FIELDS, made
        assert made["object"] == "batch" and made["status"] == "validating"
        assert all(made[name] is None for name in (*BATCH_TIMES, "cancelling_at", "cancelled_at"))
        assert made["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
        run_worker(gateway)
        done = client.get(f"/batches/{made['id']}").json()
        assert set(done) - {"notice"} == BATCH_FIELDS and done["status"] == "completed", done
        times = [done["created_at"], *(done[name] for name in BATCH_TIMES[:3])]
        assert times == sorted(times), done  # validating -> in_progress -> finalizing -> done
        assert (done["failed_at"], done["expired_at"], done["cancelled_at"]) == (None,) * 3
        assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        output = client.get(f"/files/{done['output_file_id']}").json()
        assert set(output) == FILE_FIELDS and output["purpose"] == "batch_output"
        line = orjson.loads(client.get(f"/files/{output['id']}/content").content)
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["custom_id"] == "f" and line["response"]["status_code"] == 200
        deleted = client.delete(f"/files/{upload['id']}")
        assert deleted.json() == {"id": upload["id"], "object": "file", "deleted": True}
        gone = client.get(f"/files/{upload['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found"


def test_batch_create_refuses_what_openai_refuses(gateway: Any, oai: openai.OpenAI) -> None:
    """Unknown input file (404), another endpoint, another window, metadata past
    OpenAI's bounds (16 pairs, keys 64, values 512 characters); metadata at them is kept.
    A finished batch cannot be cancelled (409, as OpenAI)."""
    upload = oai.files.create(
        file=("in.jsonl", orjson.dumps(chat_line("m", "x", max_tokens=1))), purpose="batch"
    )
    good = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions"}

    def create(**change: Any) -> Any:
        return oai.batches.create(**{**good, "completion_window": "24h", **change})

    with pytest.raises(openai.NotFoundError) as missing:
        create(input_file_id="file-nope")
    assert isinstance(missing.value.body, dict) and missing.value.body["param"] == "input_file_id"
    refused = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ]
    for change, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            create(**change)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, change
    widest = {**{f"k{i}": "v" for i in range(15)}, "k" * 64: "v" * 512}
    batch = create(metadata=widest)
    assert batch.metadata == widest and oai.batches.retrieve(batch.id).metadata == widest
    run_worker(gateway)
    assert oai.batches.retrieve(batch.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(batch.id)


def test_files_are_listed_per_key_in_openais_shape(gateway: Any, start_gateway: Any) -> None:
    """``GET /v1/files``: newest first by default, ``order``, ``limit``, the ``after``
    cursor (the SDK pages through it), ``purpose``; a batch's output file is listed with
    its owner's files; another key lists none of them; deleted and expired files leave
    the index. Before the fix every listing was a 400 (``unsupported_endpoint``)."""
    keys = ["sk-list-a", "sk-list-b"]
    options = GatewayOptions(api_keys=keys, files_dir=gateway.options.files_dir)
    with start_gateway(gateway.redis_url, options) as gw:
        a, b = (openai.OpenAI(base_url=gw.base_url, api_key=k, max_retries=0) for k in keys)
        line = orjson.dumps(chat_line("l", "listed", max_tokens=1))
        inputs = [a.files.create(file=(f"{i}.jsonl", line), purpose="batch").id for i in range(3)]
        b_file = b.files.create(file=("b.jsonl", line), purpose="batch").id
        batch = a.batches.create(
            input_file_id=inputs[0], endpoint="/v1/chat/completions", completion_window="24h"
        )
        run_worker(gateway)
        output = a.batches.retrieve(batch.id).output_file_id
        assert output is not None
        newest = [output, *inputs[::-1]]
        assert [f.id for f in a.files.list().data] == newest
        assert [f.id for f in a.files.list(limit=1)] == newest  # the SDK follows ``after``
        assert [f.id for f in a.files.list(order="asc").data] == newest[::-1]
        assert [f.id for f in a.files.list(purpose="batch_output").data] == [output]
        assert [f.id for f in a.files.list(purpose="batch").data] == inputs[::-1]
        with http(gw, keys[0]) as client:
            page = client.get("/files", params={"limit": 2}).json()
            assert set(page) == {"object", "data", "first_id", "last_id", "has_more"}
            assert page["object"] == "list" and page["has_more"] is True
            assert [f["id"] for f in page["data"]] == newest[:2]
            assert (page["first_id"], page["last_id"]) == (newest[0], newest[1])
            assert all(set(f) == FILE_FIELDS for f in page["data"])
            rest = client.get("/files", params={"after": page["last_id"]}).json()
            assert [f["id"] for f in rest["data"]] == newest[2:] and not rest["has_more"]
            oldest = client.get("/files", params={"order": "asc", "after": newest[-1]}).json()
            assert [f["id"] for f in oldest["data"]] == newest[-2::-1]
            for bad in ({"limit": 0}, {"limit": 10001}, {"order": "up"}):
                refused = client.get("/files", params=bad)
                assert refused.status_code == 400 and refused.json()["error"]["param"] in bad
            unknown = client.get("/files", params={"after": b_file})
            assert unknown.status_code == 404
        assert [f.id for f in b.files.list().data] == [b_file]
        with pytest.raises(openai.NotFoundError):
            b.files.retrieve(inputs[1])
        assert a.files.delete(inputs[1]).deleted
        conn = redis.Redis.from_url(gateway.redis_url)
        conn.delete(f"batchd:gateway:file:{inputs[2]}")  # as its TTL would
        assert [f.id for f in a.files.list().data] == [output, inputs[0]]
        index = conn.zrange(f"batchd:gateway:files:{key_id(keys[0])}", 0, -1)
        assert sorted(i.decode() for i in index) == sorted([output, inputs[0]])
        conn.close()


def test_a_batch_with_malformed_lines_fails_validation_as_openais(
    gateway: Any, oai: openai.OpenAI
) -> None:
    """OpenAI accepts the upload and fails the batch while ``validating``: every line that
    is no JSON object, repeats a custom_id or names another url than the batch's endpoint
    is one ``errors.data`` entry (line, param, code), at once (no rq retry), and no
    request runs. Before the fix
    each became an error line and the others ran (status ``completed``)."""
    good = chat_line("same", "x", max_tokens=1)
    other = {**chat_line("text", "x"), "url": "/v1/completions"}
    lines = [orjson.dumps(line) for line in (good, good, other)]
    lines += [b'{"custom_id": "broken", ', b"[1, 2]", b'{"custom_id": "utf", "x": "\xff"}']
    lines.append(b'{"custom_id": "deep", "body": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    conn = redis.Redis.from_url(gateway.redis_url)
    added = int(conn.xinfo_stream("batchd:queue:default")["entries-added"])
    upload = oai.files.create(file=("bad.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    run_worker(gateway)
    failed = oai.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.failed_at is not None, failed
    assert failed.in_progress_at is None and failed.output_file_id is None
    assert failed.request_counts is not None and failed.request_counts.total == 0
    assert failed.errors is not None and failed.errors.data is not None
    found = [(e.line, e.code, e.param) for e in failed.errors.data]
    assert found == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_url", "url"),
        (4, "invalid_json_line", None),
        (5, "invalid_json_line", None),
        (6, "invalid_json_line", None),
        (7, "invalid_json_line", None),  # nested past orjson's limit
    ]
    assert all(e.message for e in failed.errors.data)
    assert int(conn.xinfo_stream("batchd:queue:default")["entries-added"]) == added
    runner = SafeJob.fetch(batch.id, connection=conn, serializer=JSONSerializer)
    assert runner.get_status() == JobStatus.FINISHED and runner.retries_left == ABANDONED_RETRIES
    conn.close()
