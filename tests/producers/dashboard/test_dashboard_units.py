"""The dashboard's parts without Redis: sessions, charts, history, bands, latency, letters."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from starlette.requests import Request

from batchd.producers.dashboard.auth import OperatorAuth, Refused, key_id, same_origin
from batchd.producers.dashboard.charts import sparkline
from batchd.producers.dashboard.fleet.history import History, percentile
from batchd.producers.dashboard.fleet.latency import LatencyCollector, finished_from
from batchd.producers.dashboard.fleet.probe import DaemonRow, Fleet, QueueRow, band_counts
from batchd.producers.dashboard.fleet.runs import Run
from batchd.producers.dashboard.fleet.sampler import Sampler
from batchd.producers.dashboard.options import DashboardOptions
from batchd.producers.dashboard.overview import OverviewSections
from batchd.producers.dashboard.records.dead import PAYLOAD_CUT_BYTES, judge, redrive_id
from batchd.producers.dashboard.render import age, duration, environment, ms
from batchd.producers.keys import Keys
from batchd.producers.schema import Event, FinishReason, Timings, Usage

KEY = "unit-operator-key-0123456789"


def request(headers: dict[str, str], cookie: str | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"host", b"dash"))
    if cookie:
        raw.append((b"cookie", f"batchd_operator={cookie}".encode()))
    return Request({"type": "http", "method": "POST", "headers": raw, "path": "/"})


def test_a_session_is_signed_by_its_key_and_expires() -> None:
    auth = OperatorAuth((KEY,), session_ttl_s=60)
    value = auth.new_session(KEY, now=1000.0)
    operator = auth.session(value, now=1030.0)
    assert operator is not None and operator.id == key_id(KEY) and KEY not in operator.id
    assert auth.session(value, now=1061.0) is None  # expired
    expires, nonce, mac = value.split(".")
    assert auth.session(f"{int(expires) + 999}.{nonce}.{mac}", now=1030.0) is None  # tampered
    rotated = OperatorAuth(("another-key-0123456789abc",), session_ttl_s=60)
    assert rotated.session(value, now=1030.0) is None  # the key is gone: so is the session
    other = auth.session(auth.new_session(KEY, now=1000.0), now=1030.0)
    assert other is not None and other.csrf != operator.csrf  # a token per session


def test_require_tells_401_from_403_and_checks_csrf_and_origin() -> None:
    auth = OperatorAuth((KEY,), session_ttl_s=60)
    with pytest.raises(Refused) as none:
        auth.require(request({}), None)
    assert none.value.status == 401
    with pytest.raises(Refused) as wrong:
        auth.require(request({"Authorization": "Bearer nope-nope-nope-nope"}), None)
    assert wrong.value.status == 403
    assert auth.require(request({"Authorization": f"Bearer {KEY}"}), None).bearer
    cookie = auth.new_session(KEY)
    token = auth.session(cookie)
    assert token is not None
    assert auth.require(request({}, cookie), token.csrf).id == key_id(KEY)
    forged = ({"Origin": "http://evil"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"})
    for headers in forged:
        with pytest.raises(Refused):
            auth.require(request(headers, cookie), token.csrf)
    with pytest.raises(Refused):
        auth.require(request({}, cookie), "0" * 64)
    assert same_origin(request({"Origin": "http://dash", "Sec-Fetch-Site": "same-origin"}))
    with pytest.raises(Refused) as read_only:
        OperatorAuth((), session_ttl_s=60).require(request({}), None)
    assert read_only.value.status == 403


def test_options_refuse_short_operator_keys() -> None:
    with pytest.raises(ValueError, match="16 characters"):
        DashboardOptions(operator_keys=("short",))
    with pytest.raises(ValueError, match="private"):
        DashboardOptions(private=True)


def test_a_sparkline_breaks_at_gaps_and_holds_numbers_only() -> None:
    svg = str(sparkline([[1.0, 2.0, None, 4.0, 5.0], [None, None, None, None, 3.0]]))
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 1
    assert svg.startswith("<svg") and "<script" not in svg
    assert "<polyline" not in str(sparkline([[None, None]]))


def test_history_keeps_a_window_with_gaps_for_late_series() -> None:
    history = History(3)
    history.add(1.0, a=1.0)
    history.add(2.0, a=2.0, b=5.0)
    history.add(3.0, a=3.0)
    history.add(4.0, a=4.0, b=6.0)
    assert history.values("a") == [2.0, 3.0, 4.0]
    assert history.values("b") == [5.0, None, 6.0]
    assert history.span_s() == 2.0
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_priority_bands_are_read_without_parsing() -> None:
    entries = [
        {b"job": orjson.dumps({"prompt": "a", "priority": 3})},
        {b"job": b'{"prompt": "b", "priority" : -2}'},
        {b"job": orjson.dumps({"prompt": "c"})},
        {b"other": b"x"},
    ]
    assert band_counts(entries) == {"high": 1, "normal": 2, "low": 1}


def final(**fields: object) -> Event:
    base: dict[str, object] = {
        "seq": 5,
        "text": "hello",
        "finish_reason": FinishReason.stop,
        "usage": Usage(prompt_tokens=3, completion_tokens=5),
        "timings": Timings(queued=10.0, started=10.5, first_token=11.0, finished=13.0),
    }
    return Event.model_validate({**base, **fields})


def test_latency_comes_from_final_events_only() -> None:
    done = finished_from("j", final(), at=20.0)
    assert done is not None and done.ttft_s == 1.0 and done.itl_s == 0.5 and done.error is None
    assert finished_from("j", Event(seq=0, token_id=4, text="x"), at=20.0) is None
    collector = LatencyCollector(Keys(), window_s=60)
    collector.take(b"batchd:job:a:tokens", Event(seq=0, token_id=1, text="x").encode(), at=100.0)
    collector.take(b"batchd:job:a:tokens", final().encode(), at=100.0)
    failed = final(finish_reason=FinishReason.error, error="boom")
    collector.take(b"batchd:job:b:tokens", failed.encode(), at=100.0)
    collector.take(b"batchd:job:c:tokens", b'{"finish_reason": not json', at=100.0)
    figures = collector.latency(now=120.0)
    assert figures.jobs == 2 and figures.ttft_p50_s == 1.0
    assert [f.job_id for f in collector.failures] == ["b"]
    assert collector.latency(now=500.0).jobs == 0  # out of the window


def test_a_letter_is_judged_before_it_is_redriven() -> None:
    good = orjson.dumps({"id": "x", "prompt": "hi"})
    assert judge(good, None) == ({"id": "x", "prompt": "hi"}, None)
    cut = b'{"prompt": "' + b"x" * PAYLOAD_CUT_BYTES
    assert "4096 bytes" in str(judge(cut, None)[1])
    assert "invalid" in str(judge(orjson.dumps({"prompt": "hi", "n": 0}), None)[1])
    assert redrive_id("1-1", "x") == redrive_id("1-1", "x") != redrive_id("1-2", "x")


def test_formats_and_autoescape() -> None:
    assert ms(0.0123) == "12 ms" and ms(None) == "–" and ms(float("nan")) == "–"
    assert duration(75) == "1 min 15 s" and duration(7300) == "2 h 01 min"
    assert age(100.0, now=102.5) == "2.5 s ago"
    template = environment().from_string("{{ value }}")
    assert template.render(value="<b>") == "&lt;b&gt;"


def test_a_runs_eta_is_the_rate_so_far() -> None:
    run = Run("r", "bulk run", "started", 100, 25, 1, None, 10.0, 50.0, "")
    assert run.fraction == 0.25 and run.eta_s == 30.0
    assert Run("r", "bulk run", "finished", 10, 10, 0, None, 5.0, None, "").eta_s is None


def test_rates_are_counted_over_the_recent_ticks() -> None:
    sampler = Sampler(None, None, None, None, history_points=10, refresh_s=1)  # type: ignore[arg-type]

    def fleet(at: float, added: int, read: int, done: dict[str, int]) -> Fleet:
        row = QueueRow("q", 0, 0, 0, added, read, None, {}, 0, 0)
        beats = [DaemonRow(c, {"jobs_done": {"finished": n}}, 0.0) for c, n in done.items()]
        return Fleet(at, [row], beats, 0)

    first, _ = sampler._rates(fleet(100.0, 100, 50, {"a": 10}))
    assert first[0].in_per_s is None and first[0].out_per_s is None
    figures, jobs = sampler._rates(fleet(105.0, 200, 80, {"a": 20, "new": 500}))
    assert figures[0].in_per_s == 20.0 and figures[0].out_per_s == 6.0
    assert jobs == 2.0  # a daemon first seen now counts nothing of its past
    _, restarted = sampler._rates(fleet(110.0, 200, 80, {"a": 5, "new": 500}))
    assert restarted == 0.5  # "a" restarted: its 5 since
    _, later = sampler._rates(fleet(125.0, 300, 80, {"a": 5, "new": 500}))
    assert later is None  # after a gap longer than the window, no rate until the next tick


def test_the_sections_render_before_the_first_probe() -> None:
    sections = OverviewSections(environment(), History(5), refresh_s=1)
    html = sections.render(None, 0, operator=True, root="/dash")
    assert "Waiting for the first look" in html["summary"] and "No live daemon" in html["daemons"]
    assert sections.render(None, 0, operator=True, root="/dash") is html  # cached per tick


def test_many_streams_wait_for_new_versions_with_timeouts_without_an_error() -> None:
    """Streams time out and wake while ticks publish: none may raise or miss a version
    it waited for. (The Condition this replaced raised "cannot wait on un-acquired lock"
    once in a CI run, cutting a page's event stream; not reproduced here on demand.)"""
    sampler = Sampler(None, None, None, None, history_points=10, refresh_s=1)  # type: ignore[arg-type]

    async def stream(timeout: float) -> int:
        seen = woke = 0
        deadline = asyncio.get_running_loop().time() + 0.5
        while asyncio.get_running_loop().time() < deadline:
            version = await sampler.wait_newer(seen, timeout)
            woke += version > seen
            seen = version
        return woke

    async def ticks() -> None:
        for _ in range(100):
            sampler.publish()
            await asyncio.sleep(0.004)

    async def main() -> list[int]:
        waiting = [stream(0.001 * (1 + i % 7)) for i in range(40)]
        *woken, _ = await asyncio.gather(*waiting, ticks())
        return woken

    woken = asyncio.run(main())
    assert sampler.version == 100
    assert all(count > 10 for count in woken), woken
