"""Files and batches expire (OpenAI's ``expires_after``) and files can be deleted, so the
Batch API's store does not grow forever: records carry a Redis TTL, and the sweep
removes the bytes of expired files from the files folder. A real gateway, the real
daemon, a real rq worker.
"""

from __future__ import annotations

import time

import openai
import pytest
import redis

from batchd.producers.bulk_files import FilesDir
from batchd.producers.gateway.expiry import Sweeper
from batchd.producers.gateway.store import DEFAULT_EXPIRY_S, expiring
from batchd.producers.keys import Keys
from support.edge import KEY_A, Edge, chat_line, jsonl, lines_of, start_batch

LINES = jsonl([chat_line("one", "expiring", max_tokens=2)])


def test_a_file_expires_as_asked_and_its_bytes_are_swept(keyed: Edge) -> None:
    a = keyed.oai(KEY_A)
    kept = a.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert kept.expires_at == kept.created_at + DEFAULT_EXPIRY_S  # batch files: 30 days
    short = a.files.create(
        file=("in.jsonl", LINES),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert short.expires_at == short.created_at + 3600
    conn = redis.Redis.from_url(keyed.redis_url)
    assert 3590 <= conn.ttl(f"batchd:gateway:file:{short.id}") <= 3600
    on_disk = keyed.files_dir / f"{short.id}.jsonl"
    assert on_disk.exists()

    sweeper = Sweeper(conn, Keys(), FilesDir.at(keyed.files_dir))
    assert sweeper.sweep(now=short.created_at + 3601) >= 1
    assert not on_disk.exists() and (keyed.files_dir / f"{kept.id}.jsonl").exists()
    conn.pexpire(f"batchd:gateway:file:{short.id}", 1)  # what its TTL does at expires_at
    time.sleep(0.01)
    for gone in (lambda: a.files.retrieve(short.id), lambda: a.files.content(short.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    assert a.files.content(kept.id).content == LINES
    assert conn.zscore(expiring(Keys()), f"{short.id}.jsonl") is None


def test_deleting_a_file_removes_it_and_a_batch_on_it_fails_at_once(keyed: Edge) -> None:
    a = keyed.oai(KEY_A)
    batch = start_batch(a, LINES)
    deleted = a.files.delete(batch.input_file_id)
    assert (deleted.id, deleted.deleted) == (batch.input_file_id, True)
    assert not (keyed.files_dir / f"{batch.input_file_id}.jsonl").exists()
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        a.files.delete(batch.input_file_id)
    keyed.work()
    failed = a.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.errors is not None
    assert failed.errors.data is not None
    assert failed.errors.data[0].code == "input_file_unavailable"


def test_batch_outputs_and_records_expire(keyed: Edge) -> None:
    a = keyed.oai(KEY_A)
    upload = a.files.create(file=("in.jsonl", LINES), purpose="batch")
    batch = a.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    keyed.work()
    done = a.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    output = a.files.retrieve(done.output_file_id)
    assert output.expires_at is not None and output.expires_at == output.created_at + 7200
    assert lines_of(a, done.output_file_id)[0]["custom_id"] == "one"
    conn = redis.Redis.from_url(keyed.redis_url)
    ttl = conn.ttl(f"batchd:gateway:batch:{batch.id}")
    assert 24 * 3600 < ttl <= 24 * 3600 + DEFAULT_EXPIRY_S
    assert conn.zscore(expiring(Keys()), f"{batch.id}.results.jsonl") is not None

    conn.pexpire(f"batchd:gateway:batch:{batch.id}", 1)
    time.sleep(0.01)
    with pytest.raises(openai.NotFoundError):
        a.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in a.batches.list(limit=100).data]
