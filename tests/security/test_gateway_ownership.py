"""One API key can never reach another's jobs (security finding 1), tried for real: a
gateway with keys A and B, the real daemon, a real rq worker.

Before the fix a batch line could be a plain batchd job naming any id: key B's batch
then read another producer's job text, took an id before its owner used it (the
owner's idempotent submit attached to B's job), and cancelling B's batch cancelled the
other's running job. Now a batch line is an OpenAI line only (no id), the jobs a batch
makes have ids no one can guess and carry their key's id, and an idempotent submit of
a key attaches only to that key's jobs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest
import redis

from batchd.producers.client import Client
from batchd.producers.errors import ValidationError
from batchd.producers.gateway.store import key_id
from support.daemon_harness import wait_until
from support.edge import KEY_A, KEY_B, MODEL, Edge, chat_line, jsonl, lines_of, start_batch

VICTIM_PROMPT = "victim secret text"


def _error_lines(client: openai.OpenAI, batch_id: str) -> list[dict[str, Any]]:
    done = client.batches.retrieve(batch_id)
    assert done.status == "completed", done
    return lines_of(client, done.error_file_id)


def _hostile_lines(target: str) -> bytes:
    """Every way a line could name a job id: a plain batchd job, a top-level id on an
    OpenAI line, an id in the body."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    return jsonl(
        [
            {"id": target, "prompt": "x", "max_tokens": 30},
            {
                "custom_id": "top",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
                "id": target,
            },  # fmt: skip
            chat_line("inner", "x", id=target),
        ]
    )


def test_a_batch_cannot_read_another_producers_job(keyed: Edge) -> None:
    producer = Client(keyed.redis_url)
    victim = producer.submit(VICTIM_PROMPT, id="victim-read", max_tokens=18)
    assert victim.result(timeout=30).text == VICTIM_PROMPT
    conn = redis.Redis.from_url(keyed.redis_url)
    events_before = conn.xlen("batchd:job:victim-read:events")
    status_before = conn.hgetall("batchd:job:victim-read")

    b = keyed.oai(KEY_B)
    batch = start_batch(b, _hostile_lines("victim-read"))
    keyed.work()

    done = b.batches.retrieve(batch.id)
    assert done.output_file_id is None  # nothing ran: every line named an id
    errors = _error_lines(b, batch.id)
    assert len(errors) == 3
    for line in errors:
        assert VICTIM_PROMPT not in str(line)
        assert line["response"]["status_code"] == 400
    assert conn.xlen("batchd:job:victim-read:events") == events_before
    assert conn.hgetall("batchd:job:victim-read") == status_before


def test_a_batch_cannot_squat_an_id_before_its_owner_uses_it(keyed: Edge) -> None:
    b = keyed.oai(KEY_B)
    batch = start_batch(b, _hostile_lines("owner-later"))
    keyed.work()
    assert len(_error_lines(b, batch.id)) == 3
    conn = redis.Redis.from_url(keyed.redis_url)
    assert not conn.exists("batchd:job:owner-later")  # B made no job of that id

    owner = Client(keyed.redis_url).submit(
        "the owner's own prompt", id="owner-later", idempotent=True, max_tokens=8
    )
    assert owner.result(timeout=30).text == "the owne"


def test_cancelling_a_batch_never_cancels_another_producers_job(keyed: Edge) -> None:
    producer = Client(keyed.redis_url)
    victim = producer.submit("long running victim", id="victim-run", max_tokens=4000)
    wait_until(lambda: victim.status().state.value == "running", what="victim running")
    b = keyed.oai(KEY_B)
    batch = start_batch(b, _hostile_lines("victim-run"))
    b.batches.cancel(batch.id)
    keyed.work()
    assert b.batches.retrieve(batch.id).status == "cancelled"
    status = victim.status()
    assert status.state.value == "running" and not status.cancel_requested
    producer.cancel("victim-run")


def test_cancelling_a_running_batch_never_cancels_another_producers_job(keyed: Edge) -> None:
    """The cancel lands while the run is working: a run that had attached to the victim
    (its line naming the victim's id) would cancel it with its own jobs."""
    producer = Client(keyed.redis_url)
    victim = producer.submit("long running victim", id="victim-busy", max_tokens=4000)
    wait_until(lambda: victim.status().state.value == "running", what="victim running")
    b = keyed.oai(KEY_B)
    batch = start_batch(b, _hostile_lines("victim-busy"))

    def cancel_once_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = b.batches.retrieve(batch.id).status
            if state == "in_progress":
                try:
                    b.batches.cancel(batch.id)
                except openai.ConflictError:
                    pass  # it completed between the read and the cancel: asserted below
                return
            if state in ("completed", "failed", "cancelled", "expired"):
                return
            time.sleep(0.05)

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    keyed.work()  # rq runs in this (the main) thread
    canceller.join(70)
    assert b.batches.retrieve(batch.id).status in ("cancelled", "completed")
    status = victim.status()
    assert status.state.value == "running" and not status.cancel_requested
    producer.cancel("victim-busy")


def test_a_keyed_submit_attaches_only_to_its_own_keys_job(keyed: Edge) -> None:
    client = Client(keyed.redis_url)
    mine = key_id(KEY_A)
    client.submit_request({"id": "owned-a", "prompt": "a", "max_tokens": 2}, key_id=mine)
    again = client.submit_request(
        {"id": "owned-a", "prompt": "a", "max_tokens": 2}, idempotent=True, key_id=mine
    )
    assert again.id == "owned-a"
    with pytest.raises(ValidationError, match="is not this key's"):
        client.submit_request(
            {"id": "owned-a", "prompt": "b", "max_tokens": 2}, idempotent=True, key_id=key_id(KEY_B)
        )
    raw = Client(keyed.redis_url).submit("raw", id="raw-job", max_tokens=2)  # no key: trusted
    with pytest.raises(ValidationError, match="is not this key's"):
        client.submit_request(
            {"id": raw.id, "prompt": "b", "max_tokens": 2}, idempotent=True, key_id=mine
        )


def test_jobs_carry_their_keys_id_and_never_the_key(keyed: Edge) -> None:
    a = keyed.oai(KEY_A)
    reply = a.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ownership"}], max_tokens=4
    )
    job_id = reply.id.removeprefix("chatcmpl-")
    assert len(job_id) == 32 and int(job_id, 16) >= 0  # 128 random bits
    batch = start_batch(a, jsonl([chat_line("one", "batch job", max_tokens=3)]))
    keyed.work()
    output = lines_of(a, a.batches.retrieve(batch.id).output_file_id)
    batch_job = output[0]["response"]["request_id"]
    conn = redis.Redis.from_url(keyed.redis_url)
    for job in (job_id, batch_job):
        assert conn.hget(f"batchd:job:{job}", "key_id") == key_id(KEY_A).encode()
    dumped = b"".join(
        b"".join(str(v).encode() for v in _dump(conn, k)) for k in conn.scan_iter("*")
    )
    assert KEY_A.encode() not in dumped and KEY_B.encode() not in dumped


def _dump(conn: redis.Redis, key: bytes) -> list[Any]:
    kind = conn.type(key)
    if kind == b"hash":
        return list(conn.hgetall(key).items())
    if kind == b"string":
        return [conn.get(key)]
    if kind == b"stream":
        return conn.xrange(key)
    if kind == b"zset":
        return conn.zrange(key, 0, -1)
    return [key]


def test_another_keys_files_and_batches_are_404_and_untouched(keyed: Edge) -> None:
    a, b = keyed.oai(KEY_A), keyed.oai(KEY_B)
    batch = start_batch(a, jsonl([chat_line("x", "mine", max_tokens=2)]))
    before = (a.batches.retrieve(batch.id), a.files.retrieve(batch.input_file_id))
    attempts = [
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.files.retrieve(batch.input_file_id),
        lambda: b.files.content(batch.input_file_id),
        lambda: b.files.delete(batch.input_file_id),
        lambda: b.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ),
    ]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in [x.id for x in b.batches.list().data]
    time.sleep(0.05)
    assert (a.batches.retrieve(batch.id), a.files.retrieve(batch.input_file_id)) == before
    assert a.files.content(batch.input_file_id).text.startswith('{"custom_id":"x"')
    a.batches.cancel(batch.id)
