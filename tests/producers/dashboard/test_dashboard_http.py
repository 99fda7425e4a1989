"""The dashboard over HTTP (no browser) against a real redis-server: escaping, the rules
of actions (401/403, CSRF, origin), re-drive and control by API, search, job streams."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from dashboard_helpers import run_dashboard
from starlette.testclient import TestClient

from batchd.producers.client import Client
from batchd.producers.dashboard.app import create_app
from batchd.producers.dashboard.auth import COOKIE
from batchd.producers.dashboard.options import DashboardOptions
from batchd.producers.dashboard.records.dead import redrive_id
from batchd.producers.gateway.serving.beat import gateway_beat
from batchd.producers.keys import EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.schema import Event, JobState, JobStatus, Timings, Usage
from support.daemon_harness import wait_until
from support.redis_server import RedisServer

KEY = "http-operator-key-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
KEYS = Keys()
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture
def app_client(redis_server: RedisServer) -> Iterator[TestClient]:
    options = DashboardOptions(operator_keys=(KEY,), refresh_s=0.2, discovery_s=0.1, latency=False)
    with TestClient(create_app(redis_server.url, options), base_url="http://dash") as client:
        yield client


def letter(client: redis.Redis, job_id: str, payload: bytes, error: str = "poison") -> str:
    fields = {"id": job_id, "queue": "default", "entry": "1-1", "error": error, "payload": payload}
    return str(client.xadd(KEYS.dead, fields).decode())  # type: ignore[arg-type]


def heartbeat(client: redis.Redis, consumer: str, **extra: Any) -> None:
    now = time.time()
    beat = {"consumer": consumer, "model": "/srv/models/tiny", "queues": ["default"], "at": now}
    client.set(KEYS.daemon(consumer), orjson.dumps({**beat, **extra}), ex=60)


def test_pages_escape_everything_redis_holds(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    conn = redis_server.client()
    with Client(redis_server.url) as producer:
        job = producer.submit(HOSTILE, max_tokens=4, metadata={"note": HOSTILE})
    letter(conn, HOSTILE, orjson.dumps({"prompt": HOSTILE}), error=HOSTILE)
    heartbeat(conn, "<b>daemon</b>", model=HOSTILE)
    time.sleep(0.5)  # a tick sees the daemon
    pages = ["/", f"/jobs/{job.id}", "/dead", f"/jobs?meta=note%3D{HOSTILE}"]
    for path in pages:
        answer = app_client.get(path)
        assert answer.status_code == 200, path
        assert "<script>alert" not in answer.text and "<b>daemon" not in answer.text, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in app_client.get(f"/jobs/{job.id}").text
    assert "&lt;b&gt;daemon&lt;/b&gt;" in app_client.get("/").text
    headers = app_client.get("/").headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["cache-control"] == "no-store"


def test_actions_answer_401_without_an_operator_and_403_when_refused(
    app_client: TestClient,
) -> None:
    for path in ("/jobs/x/cancel", "/dead/redrive", "/daemons/d/control"):
        answer = app_client.post(path)
        assert answer.status_code == 401, path
        assert answer.headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer a-wrong-key-of-some-length"}
        assert app_client.post(path, headers=wrong).status_code == 403, path
    app_client.cookies.set(COOKIE, "1.forged.session")
    assert app_client.post("/jobs/x/cancel").status_code == 403


def test_a_session_needs_its_csrf_token_and_the_same_origin(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    with Client(redis_server.url) as producer:
        job = producer.submit("hi", max_tokens=4, queue="parked")
    refused = app_client.post("/login", data={"key": "not-the-key-0123456789"})
    assert refused.status_code == 403
    login = app_client.post("/login", data={"key": KEY}, follow_redirects=False)
    assert login.status_code == 303
    cookie = login.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    page = app_client.get(f"/jobs/{job.id}").text
    token = page.split('name="csrf-token" content="')[1].split('"')[0]
    cancel = f"/jobs/{job.id}/cancel"
    assert app_client.post(cancel).status_code == 403  # no token
    assert app_client.post(cancel, data={"csrf": "0" * 64}).status_code == 403
    cross = {"Origin": "http://evil.example"}
    assert app_client.post(cancel, data={"csrf": token}, headers=cross).status_code == 403
    site = {"Sec-Fetch-Site": "cross-site"}
    assert app_client.post(cancel, data={"csrf": token}, headers=site).status_code == 403
    assert redis_server.client().hget(KEYS.job(job.id), "cancel_requested") != b"1"
    done = app_client.post(
        cancel, data={"csrf": token}, headers={"Origin": "http://dash"}, follow_redirects=False
    )
    assert done.status_code == 303 and done.headers["location"].endswith("?done=cancel")
    assert redis_server.client().hget(KEYS.job(job.id), "cancel_requested") == b"1"
    audit = redis_server.client().xrange("batchd:dashboard:audit")
    outcomes = [(f[b"action"], f[b"outcome"]) for _, f in audit]
    assert (b"login", b"refused") in outcomes and (b"cancel", b"requested") in outcomes


def test_redrive_by_api_makes_one_new_job_per_letter_and_refuses_what_would_fail(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    conn = redis_server.client()
    good = letter(conn, "old-1", orjson.dumps({"id": "old-1", "prompt": "hi", "max_tokens": 3}))
    cut = letter(conn, "old-2", b'{"id": "old-2", "prompt": "' + b"x" * 5000)
    bad = letter(conn, "old-3", orjson.dumps({"id": "old-3", "prompt": "hi", "max_tokens": -1}))
    entries = {"entry": [good, cut, bad], "note": "after the fix"}
    answer = app_client.post("/dead/redrive", data=entries, headers=BEARER)
    assert answer.status_code == 200
    body = answer.json()
    new_id = redrive_id(good, "old-1")
    assert body["redriven"] == [{"entry": good, "job": new_id, "before": False}]
    reasons = {r["entry"]: r["error"] for r in body["refused"]}
    assert "4096 bytes" in reasons[cut] and "max_tokens" in reasons[bad]
    status = JobStatus.from_hash(conn.hgetall(KEYS.job(new_id)))
    assert status.state is JobState.queued
    request = orjson.loads(conn.xrange(KEYS.queue())[-1][1][JOB_FIELD.encode()])
    assert request["id"] == new_id and request["prompt"] == "hi"
    again = app_client.post("/dead/redrive", data={"entry": [good]}, headers=BEARER).json()
    assert again["redriven"] == [{"entry": good, "job": new_id, "before": True}]
    assert conn.xlen(KEYS.queue()) == 1  # a second re-drive submits nothing
    page = app_client.get("/dead").text
    assert f'data-redriven="{new_id}"' in page
    assert "old-1" in app_client.get(f"/jobs/{new_id}").text  # re-driven from
    notes = [f[b"note"] for _, f in conn.xrange("batchd:dashboard:audit")]
    assert notes.count(b"after the fix") == 3


def test_a_daemon_control_is_written_only_when_the_daemon_announces_it(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    conn = redis_server.client()
    heartbeat(conn, "plain:1")
    heartbeat(conn, "able:2", controls=["pause", "resume", "drain"])
    refused = app_client.post("/daemons/plain:1/control", data={"action": "pause"}, headers=BEARER)
    assert refused.status_code == 409 and not conn.exists("batchd:control:plain:1")
    gone = app_client.post("/daemons/gone:3/control", data={"action": "pause"}, headers=BEARER)
    assert gone.status_code == 409
    answer = app_client.post("/daemons/able:2/control", data={"action": "drain"}, headers=BEARER)
    assert answer.status_code == 200
    held = conn.hgetall("batchd:control:able:2")
    assert held[b"drain"] == b"1" and held[b"by"].startswith(b"op-")
    time.sleep(0.5)
    app_client.post("/login", data={"key": KEY})
    overview = app_client.get("/").text
    assert 'action="/daemons/able%3A2/control"' in overview
    assert 'action="/daemons/plain%3A1/control"' not in overview


def test_the_overview_lists_the_gateways_alive(redis_server: RedisServer) -> None:
    conn = redis_server.client()
    options = DashboardOptions(refresh_s=0.2, discovery_s=0.2, latency=False)
    none = "No live <code>batchd gateway</code>"
    with run_dashboard(redis_server.url, options) as dashboard:
        assert none in httpx.get(dashboard.url).text
        with gateway_beat(conn, KEYS, queue="default") as beat:  # what a gateway app runs
            shown = f'data-gateway="{beat.fields["name"]}"'
            wait_until(lambda: shown in httpx.get(dashboard.url).text, what="gateway shown")
            assert "queue default" in httpx.get(dashboard.url).text
        wait_until(lambda: none in httpx.get(dashboard.url).text, what="gateway gone")


def test_a_private_dashboard_and_a_read_only_one(redis_server: RedisServer) -> None:
    private = DashboardOptions(operator_keys=(KEY,), private=True, latency=False)
    with TestClient(create_app(redis_server.url, private), base_url="http://dash") as client:
        assert client.get("/", follow_redirects=False).headers["location"] == "/login"
        assert client.get("/jobs/x", follow_redirects=False).status_code == 303
        client.post("/login", data={"key": KEY})
        assert client.get("/").status_code == 200
    read_only = DashboardOptions(latency=False)
    with TestClient(create_app(redis_server.url, read_only), base_url="http://dash") as client:
        assert client.get("/login").status_code == 404
        assert client.post("/jobs/x/cancel", headers=BEARER).status_code == 403
        assert "operator login" not in client.get("/").text


def write_job(conn: redis.Redis, job_id: str, state: str, texts: list[str], **meta: Any) -> None:
    """A job as a daemon leaves it: token events, a final event, a status hash."""
    for seq, text in enumerate(texts):
        event = Event(seq=seq, token_id=seq + 3, text=text)
        conn.xadd(KEYS.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    now = time.time()
    if state != "running":
        final = Event(
            seq=len(texts),
            text="".join(texts),
            finish_reason="length",  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=3, completion_tokens=len(texts)),
            timings=Timings(queued=now - 2, started=now - 1.5, first_token=now - 1, finished=now),
            metadata=meta,
        )
        conn.xadd(KEYS.events(job_id), {EVENT_FIELD: final.encode()}, id=event_id(len(texts)))
    status = JobStatus(state=JobState(state), queue="default", queued_at=now - 2)
    conn.hset(KEYS.job(job_id), mapping=status.to_hash())  # type: ignore[arg-type]


def test_search_finds_jobs_by_id_start_state_and_metadata(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    conn = redis_server.client()
    write_job(conn, "alpha-1", "finished", ["a"], team="red")
    write_job(conn, "alpha-2", "finished", ["b"], team="blue")
    write_job(conn, "beta-1", "running", ["c"])
    found = app_client.get("/jobs?id=alpha").text
    assert "alpha-1" in found and "alpha-2" in found and "beta-1" not in found
    found = app_client.get("/jobs?meta=team%3Dblue").text
    assert "alpha-2" in found and "alpha-1" not in found
    found = app_client.get("/jobs?state=running").text
    assert "beta-1" in found and "alpha-1" not in found
    assert "beta-1" in app_client.get("/jobs").text  # no filter: a first page of jobs


def sse_events(client: TestClient, url: str, **headers: str) -> list[tuple[str, Any]]:
    """(event, data) of a stream, up to and with its ``final`` event."""
    events: list[tuple[str, Any]] = []
    name = ""
    with client.stream("GET", url, headers=headers) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, orjson.loads(line[6:])))
                if name == "final":
                    break
    return events


def test_a_job_stream_replays_after_the_seq_the_page_shows_then_ends(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    write_job(redis_server.client(), "streamed", "finished", ["one ", "two ", "three"])
    page = app_client.get("/jobs/streamed").text
    assert 'data-ended="1"' in page and "one two three" in page
    events = sse_events(app_client, "/live/jobs/streamed?after=0")
    tokens = [t for name, data in events if name == "tokens" for t in data]
    assert [t["seq"] for t in tokens] == [1, 2]
    assert events[-1][0] == "final" and events[-1][1]["texts"] == {"0": "one two three"}
    resumed = sse_events(app_client, "/live/jobs/streamed?after=0", **{"Last-Event-ID": "1"})
    assert [t["seq"] for name, data in resumed if name == "tokens" for t in data] == [2]
