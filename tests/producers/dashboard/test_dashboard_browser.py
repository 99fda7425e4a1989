"""The dashboard in a real headless Chromium, against a real redis-server and daemon.

What a user sees: the overview with the live daemon and a queue depth that moves as
jobs are submitted; a job's tokens arriving live, its final text the client's (also
after a reload mid-job); a dead letter re-driven from the page into a job that
completes; a cancel from the page; no action button and no accepted action without the
operator key. Every page fails its test on a console error; screenshots are saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis
from dashboard_helpers import CONSUMER, OPERATOR_KEY, PHONE, Dashboard, PageWatch, log_in

import batchd
from batchd.producers.client import Client
from batchd.producers.errors import JobFailed
from batchd.producers.keys import CONSUMER_GROUP, JOB_FIELD, Keys
from batchd.producers.schema import JobState, JobStatus, now
from support.daemon_harness import wait_until

pytestmark = pytest.mark.timeout(180)

OpenPage = Callable[..., PageWatch]
KEYS = Keys()
PARKED = "parked"  # a queue no daemon serves: its depth only grows


@pytest.fixture
def client(dashboard: Dashboard) -> Any:
    with Client(dashboard.redis_url) as c:
        yield c


def assert_fits_a_phone(open_page: OpenPage, url: str, shot: str | None = None) -> None:
    """The page at ``url`` on a phone-sized screen: no sideways scrolling of the page
    (wide tables scroll inside their cards)."""
    phone = open_page(viewport=PHONE)
    phone.page.goto(url)
    phone.page.wait_for_selector("main")
    if shot:
        phone.shot(shot)
    width = phone.page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"{url} scrolls sideways on a phone ({width}px)"


def test_overview_shows_the_live_daemon_and_a_moving_queue_depth(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    watch = open_page()
    watch.page.goto(dashboard.url)
    row = watch.page.locator(f'tr[data-daemon="{CONSUMER}"]')
    row.wait_for()
    assert "tiny" in row.inner_text()
    watch.page.wait_for_selector('[data-live-state="on"]')
    try:
        client.submit_many([{"prompt": f"p{i}", "max_tokens": 4} for i in range(3)], queue=PARKED)
        depth = f'tr[data-queue="{PARKED}"] [data-figure="unread"]'
        watch.page.wait_for_function(
            "s => document.querySelector(s)?.textContent.trim() === '3'", arg=depth
        )
        client.submit_many([{"prompt": f"q{i}", "max_tokens": 4} for i in range(4)], queue=PARKED)
        watch.page.wait_for_function(  # live: no reload
            "s => document.querySelector(s)?.textContent.trim() === '7'", arg=depth
        )
        # the daemon's own queue moves too: jobs go through it and the charts get samples
        handles = [client.submit(f"hello {i}", max_tokens=24) for i in range(6)]
        for handle in handles:
            handle.result(timeout=60)
        time.sleep(1.0)
        watch.shot("dashboard-overview")
        assert_fits_a_phone(open_page, dashboard.url, "dashboard-overview-phone")
    finally:
        client.redis.delete(KEYS.queue(PARKED))


def test_a_job_page_shows_tokens_arriving_and_ends_with_the_clients_text(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    watch = open_page()
    job = client.submit(
        "Once upon a time", max_tokens=400, ignore_eos=True, metadata={"case": "live"}
    )
    watch.page.goto(f"{dashboard.url}/jobs/{job.id}")
    # Record the text's length each time it changes, from the first moment on.
    watch.page.evaluate(
        """() => {
            const pre = document.querySelector('pre[data-index="0"]');
            window.lengths = [pre.textContent.length];
            new MutationObserver(() => window.lengths.push(pre.textContent.length))
                .observe(pre, {childList: true, characterData: true, subtree: true});
        }"""
    )
    # Ended: the final event's text is shown (the status section can say finished a
    # moment before, from its own event).
    watch.page.wait_for_selector('[data-ended="1"]', state="attached", timeout=90_000)
    result = job.result(timeout=30)
    text = watch.page.locator('pre[data-index="0"]').text_content()
    assert text == result.text
    lengths = watch.page.evaluate("window.lengths")
    growing = [n for n in lengths if 0 < n < len(result.text)]
    assert len(set(growing)) >= 2, f"no token seen arriving before the end: {lengths}"
    assert "live" in watch.page.inner_text("body")  # metadata shown
    watch.shot("dashboard-job")
    assert_fits_a_phone(open_page, f"{dashboard.url}/jobs/{job.id}", "dashboard-job-phone")


def test_a_job_page_reloaded_mid_job_resumes_and_ends_with_the_clients_text(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    watch = open_page()
    job = client.submit("A reload", max_tokens=600, ignore_eos=True)
    watch.page.goto(f"{dashboard.url}/jobs/{job.id}")
    watch.page.wait_for_function(
        "() => document.querySelector('pre[data-index=\"0\"]').textContent.length > 0"
    )
    watch.page.reload()
    watch.page.wait_for_selector('[data-ended="1"]', state="attached", timeout=90_000)
    result = job.result(timeout=30)
    assert watch.page.locator('pre[data-index="0"]').text_content() == result.text


def test_a_cancel_from_the_page_ends_the_job(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    watch = open_page()
    log_in(watch, dashboard.url)
    job = client.submit("Never ending", max_tokens=4000, ignore_eos=True)
    wait_until(lambda: job.status().state is JobState.running, timeout=30, what="running")
    watch.page.goto(f"{dashboard.url}/jobs/{job.id}")
    watch.page.click('button[data-action="cancel"]')  # the dialog is accepted
    watch.page.wait_for_selector('[data-state="cancelled"]', timeout=60_000)
    with pytest.raises(JobFailed):
        job.result(timeout=30)
    assert job.status().state is JobState.cancelled
    watch.shot("dashboard-job-cancelled")


def make_poison(redis_url: str, job: dict[str, Any]) -> str:
    """A job delivered once to a consumer with no heartbeat (a daemon that died holding
    it, running it alone, once before too: batchd.daemon.fleet.poison): the live daemon
    claims it, counts a second crash while it ran alone with no progress, and
    dead-letters it as poison."""
    conn = redis.Redis.from_url(redis_url)
    status = JobStatus(state=JobState.queued, queue="default", queued_at=now()).to_hash()
    status.update(alone_delivery="1", alone_from="0", alone_crashes="1")
    with conn.pipeline(transaction=True) as pipe:  # atomic: the daemon cannot read it first
        pipe.hset(KEYS.job(job["id"]), mapping=status)  # type: ignore[arg-type]
        pipe.xadd(KEYS.queue(), {JOB_FIELD: orjson.dumps(job)})
        pipe.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.queue(): ">"}, count=1)
        pipe.execute()
    return str(job["id"])


def test_a_dead_letter_is_redriven_from_the_page_and_its_new_job_completes(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    job_id = make_poison(
        dashboard.redis_url, {"id": "poisoned-1", "prompt": "again", "max_tokens": 8}
    )
    wait_until(
        lambda: any(f[b"id"] == job_id.encode() for _, f in client.redis.xrange(KEYS.dead)),
        timeout=30,
        what="dead letter",
    )
    watch = open_page()
    log_in(watch, dashboard.url)
    watch.page.goto(f"{dashboard.url}/dead")
    row = watch.page.locator("tr[data-letter]", has_text=job_id)
    assert "poison" in row.inner_text()
    watch.shot("dashboard-dead-letters")
    assert_fits_a_phone(open_page, f"{dashboard.url}/dead", "dashboard-dead-letters-phone")
    watch.page.fill('input[name="note"]', "fixed the worker")
    row.locator('button[data-action="redrive-one"]').click()
    link = watch.page.locator("tr[data-letter]", has_text=job_id).locator("[data-redriven]")
    new_id = link.get_attribute("data-redriven")
    assert new_id and new_id != job_id
    client.result(new_id, timeout=60)
    link.click()
    watch.page.wait_for_selector('[data-state="finished"]', timeout=60_000)
    assert job_id in watch.page.inner_text('[data-section="status"]')  # re-driven from
    audit = client.redis.xrevrange("batchd:dashboard:audit", count=5)
    assert any(f[b"action"] == b"redrive" and f[b"note"] == b"fixed the worker" for _, f in audit)


def test_without_the_operator_key_no_action_is_offered_or_accepted(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    job = client.submit("Read only", max_tokens=3000, ignore_eos=True)
    try:
        watch = open_page()
        watch.page.goto(f"{dashboard.url}/jobs/{job.id}")
        watch.page.wait_for_selector("[data-state]")
        assert watch.page.locator('button[data-action="cancel"]').count() == 0
        watch.page.goto(f"{dashboard.url}/dead")
        assert watch.page.locator('button[data-action^="redrive"]').count() == 0
        assert watch.page.locator('input[name="entry"]').count() == 0
        watch.page.goto(dashboard.url)
        assert watch.page.locator("td.actions").count() == 0
        watch.shot("dashboard-read-only")
        url = dashboard.url
        cancel = f"{url}/jobs/{job.id}/cancel"
        assert httpx.post(cancel).status_code == 401
        assert httpx.post(f"{url}/dead/redrive", data={"entry": "1-1"}).status_code == 401
        assert httpx.post(f"{url}/daemons/{CONSUMER}/control").status_code == 401
        wrong = {"Authorization": "Bearer not-the-operator-key-at-all"}
        assert httpx.post(cancel, headers=wrong).status_code == 403
        assert job.status().state is not JobState.cancelled
        with httpx.Client(base_url=url) as browserless:  # a session, but no CSRF token
            browserless.post("/login", data={"key": OPERATOR_KEY})
            assert browserless.post(f"/jobs/{job.id}/cancel").status_code == 403
            other_site = {"Origin": "https://evil.example"}
            assert browserless.post(f"/jobs/{job.id}/cancel", headers=other_site).status_code == 403
        assert not job.status().cancel_requested
    finally:
        client.cancel(job.id)


def test_an_operator_pauses_and_resumes_the_daemon_from_the_overview(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    watch = open_page()
    log_in(watch, dashboard.url)
    watch.page.goto(dashboard.url)
    row = watch.page.locator(f'tr[data-daemon="{CONSUMER}"]')
    watch.page.wait_for_function(  # the heartbeat's figures: KV blocks and version
        "s => /blocks/.test(document.querySelector(s)?.textContent)",
        arg=f'tr[data-daemon="{CONSUMER}"]',
    )
    assert batchd.__version__ in row.inner_text()

    def press(action: str) -> None:
        # The sections are replaced live: find the button afresh each time.
        watch.page.locator(
            f'tr[data-daemon="{CONSUMER}"] form:has(input[value="{action}"]) button'
        ).click()

    def shown(state: str) -> None:
        watch.page.wait_for_selector(f'tr[data-daemon="{CONSUMER}"] .state.s-{state}')

    try:
        press("pause")
        shown("paused")
        watch.shot("dashboard-daemon-paused")
        job = client.submit("Held back", max_tokens=4)
        time.sleep(1.0)  # many heartbeat intervals: the daemon would have read it
        assert job.status().state is JobState.queued
        press("resume")
        shown("idle")
        assert job.result(timeout=60).finish_reason is not None
        audit = client.redis.xrevrange("batchd:dashboard:audit", count=5)
        done = {f[b"action"] for _, f in audit if f[b"outcome"] == b"requested"}
        assert done >= {b"daemon pause", b"daemon resume"}
    finally:
        client.redis.hset(KEYS.control(CONSUMER), mapping={"intake": "open", "drain": "0"})


def test_search_and_batches_pages(
    dashboard: Dashboard, client: Client, open_page: OpenPage
) -> None:
    job = client.submit("Find me", max_tokens=4, metadata={"team": "search"})
    job.result(timeout=60)
    watch = open_page()
    watch.page.goto(f"{dashboard.url}/jobs?state=finished&meta=team%3Dsearch")
    watch.page.wait_for_selector(f'a[href$="/jobs/{job.id}"]')
    watch.shot("dashboard-jobs")
    assert_fits_a_phone(open_page, f"{dashboard.url}/jobs?state=finished")
    watch.page.goto(f"{dashboard.url}/batches")
    watch.page.wait_for_selector('[data-section="runs"]')
    watch.shot("dashboard-batches")
