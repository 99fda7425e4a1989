"""The live streams: the overview's ticks, a job's tokens, and pages refreshed in place.

A job stream replays the job's events after the seq the page already shows (the
``after`` query, or ``Last-Event-ID`` when EventSource reconnects), then follows it
live through the client's follower (race-free, gap-free, across Redis reconnects),
sending the tokens that arrived together as one ``tokens`` event, the status section
when the status hash changes, and ``final`` at the end. So a page reloaded mid-job
shows the text so far at once and goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import Response

from batchd.producers.dashboard import sse
from batchd.producers.dashboard.context import Dashboard
from batchd.producers.dashboard.overview import OverviewSections
from batchd.producers.dashboard.records.jobs import JobPage, load_status, page_take
from batchd.producers.errors import JobNotFound
from batchd.producers.keys import is_name
from batchd.producers.schema import Event

STATUS_EVERY_S = 1.0
# Tokens sent in one event at most (a burst after a pause is cut in parts).
BATCH = 512
_END = object()


def overview_stream(dash: Dashboard, sections: OverviewSections) -> Callable[[Request], Any]:
    async def handler(request: Request) -> Response:
        operator = dash.operator(request) is not None
        root = request.scope.get("root_path", "")
        sampler = dash.sampler

        async def events() -> AsyncIterator[str]:
            seen, shown = -1, dict[str, str]()
            while True:
                version = await sampler.wait_newer(seen, sse.KEEPALIVE_S)
                if version == seen:
                    yield sse.KEEPALIVE
                    continue
                seen = version
                html = sections.render(sampler.latest, version, operator=operator, root=root)
                changed = {name: text for name, text in html.items() if shown.get(name) != text}
                shown = html
                if changed:  # only what changed since this browser's last update
                    yield sse.event("sections", changed)

        return sse.stream(events())

    return handler


def refreshing_stream(
    dash: Dashboard, render: Callable[[Request], Any], *, every_s: float
) -> Callable[[Request], Any]:
    """A stream that re-renders a page's sections every ``every_s`` (sent when changed)."""

    async def handler(request: Request) -> Response:
        async def events() -> AsyncIterator[str]:
            last: dict[str, str] = {}
            idle = 0.0
            while True:
                await asyncio.sleep(every_s)
                try:
                    html = await render(request)
                except (redis.RedisError, OSError):
                    continue
                if html != last:
                    last, idle = html, 0.0
                    yield sse.event("sections", html)
                else:
                    idle += every_s
                    if idle >= sse.KEEPALIVE_S:
                        idle = 0.0
                        yield sse.KEEPALIVE

        return sse.stream(events())

    return handler


def job_stream(dash: Dashboard) -> Callable[[Request], Any]:
    async def handler(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        if not is_name(job_id):
            return Response("no such job", status_code=404)
        query, header = request.query_params.get("after"), request.headers.get("last-event-id")
        after = max(_int(query), _int(header))
        return sse.stream(_job_events(dash, request, job_id, after))

    return handler


async def _job_events(
    dash: Dashboard, request: Request, job_id: str, after: int
) -> AsyncIterator[str]:
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    follower = asyncio.ensure_future(_follow(dash, job_id, after, inbox))
    shown, shown_at = "", float("-inf")
    try:
        while True:
            items = await _next_items(inbox)
            tokens = [i for i in items if isinstance(i, Event) and not i.final]
            if tokens:
                yield sse.event(
                    "tokens",
                    [{"seq": e.seq, "index": e.index or 0, "text": e.text} for e in tokens],
                    event_id=tokens[-1].seq,
                )
            if any(isinstance(i, JobNotFound) for i in items):
                yield sse.event("gone", {"job": job_id})
                return
            final = next((i for i in items if isinstance(i, Event) and i.final), None)
            ended = final is not None or _END in items
            if not ended and time.monotonic() - shown_at < STATUS_EVERY_S:
                continue
            try:
                page = await load_status(dash.redis, dash.keys, job_id)
            except (redis.RedisError, OSError):
                if ended:
                    return  # the browser reconnects and replays from its last seq
                continue  # the follower waits for Redis; the status can wait too
            status, shown_at = _status_html(dash, request, page), time.monotonic()
            if ended:
                if final is not None:
                    page_take(page, final)
                texts = {str(k): v for k, v in page.texts.items()}
                yield sse.event("final", {"texts": texts, "status": status}, event_id=page.last_seq)
                return
            if status != shown:
                shown = status
                yield sse.event("status", {"status": status})
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await follower


async def _next_items(inbox: asyncio.Queue[Any]) -> list[Any]:
    """What arrived: waits up to STATUS_EVERY_S for the first item, takes the rest."""
    try:
        items = [await asyncio.wait_for(inbox.get(), STATUS_EVERY_S)]
    except asyncio.TimeoutError:
        return []
    while not inbox.empty() and len(items) < BATCH:
        items.append(inbox.get_nowait())
    return items


async def _follow(dash: Dashboard, job_id: str, after: int, inbox: asyncio.Queue[Any]) -> None:
    """Feed the job's events into ``inbox``, then ``_END`` (or the JobNotFound)."""
    try:
        async for event in dash.client.stream(job_id, after_seq=after):
            await inbox.put(event)
    except JobNotFound as exc:
        await inbox.put(exc)
        return
    await inbox.put(_END)


def _status_html(dash: Dashboard, request: Request, page: JobPage) -> str:
    return dash.fragment(request, "sections/job_status.html", job=page)


def _int(text: str | None) -> int:
    try:
        return max(-1, int(text)) if text is not None else -1
    except ValueError:
        return -1
