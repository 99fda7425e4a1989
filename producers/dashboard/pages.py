"""The pages (GET): overview, job search, one job, dead letters, batches, login.

Each handler reads Redis, then renders one template; none writes anything. A private
dashboard sends a visitor without an operator session to the login page.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from batchd.producers.dashboard.context import Dashboard
from batchd.producers.dashboard.fleet.runs import read_runs
from batchd.producers.dashboard.overview import OverviewSections
from batchd.producers.dashboard.records.dead import (
    count_letters,
    parse_letter_name,
    read_letters,
)
from batchd.producers.dashboard.records.jobs import load_job
from batchd.producers.dashboard.records.search import JobQuery, search
from batchd.producers.schema import JobState

Handler = Callable[[Request], Awaitable[Response]]
STATES = tuple(state.value for state in JobState)


class Pages:
    """The GET handlers of one dashboard."""

    def __init__(self, dash: Dashboard, sections: OverviewSections) -> None:
        self.dash = dash
        self.sections = sections

    def guarded(self, handler: Handler) -> Handler:
        """``handler``, behind the login page when the dashboard is private."""

        async def page(request: Request) -> Response:
            if self.dash.options.private and self.dash.operator(request) is None:
                root = request.scope.get("root_path", "")
                return RedirectResponse(f"{root}/login", status_code=303)
            return await handler(request)

        return page

    async def overview(self, request: Request) -> Response:
        sampler = self.dash.sampler
        root = request.scope.get("root_path", "")
        operator = self.dash.operator(request) is not None
        html = self.sections.render(sampler.latest, sampler.version, operator=operator, root=root)
        return self.dash.page(
            request, "overview.html", sections={k: Markup(v) for k, v in html.items()}
        )

    async def jobs(self, request: Request) -> Response:
        params = request.query_params
        query = JobQuery(
            id=params.get("id", "").strip(),
            state=params.get("state", "") if params.get("state", "") in STATES else "",
            queue=params.get("queue", "").strip(),
            meta=params.get("meta", "").strip(),
        )
        cursor = _int(params.get("cursor"))
        found = await search(
            self.dash.redis,
            self.dash.keys,
            query,
            cursor=cursor,
            max_keys=self.dash.options.search_scan_keys,
            limit=self.dash.options.page_size,
        )
        return self.dash.page(request, "jobs.html", query=query, found=found, states=STATES)

    async def job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        page = await load_job(self.dash.redis, self.dash.keys, job_id)
        if page is None:
            return self.dash.page(
                request,
                "error.html",
                status=404,
                title="No such job",
                message=f"Redis holds no job {job_id!r} (never submitted, or expired).",
            )
        return self.dash.page(request, "job.html", job=page, done=request.query_params.get("done"))

    async def dead(self, request: Request) -> Response:
        return self.dash.page(request, "dead.html", **await self.dead_context(request))

    async def dead_context(self, request: Request) -> dict[str, Any]:
        before = request.query_params.get("before")
        before = before if before and parse_letter_name(self.dash.keys, before) else None
        letters = await read_letters(
            self.dash.redis,
            self.dash.keys,
            count=self.dash.options.page_size,
            before=before,
            limits=self.dash.options.limits,
        )
        total = await count_letters(self.dash.redis, self.dash.keys)
        return {
            "letters": letters,
            "total": total,
            "before": before,
            "redriven": request.query_params.get("redriven"),
        }

    async def dead_sections(self, request: Request) -> dict[str, str]:
        context = await self.dead_context(request)
        return {"letters": self.dash.fragment(request, "sections/dead_letters.html", **context)}

    async def batches(self, request: Request) -> Response:
        return self.dash.page(request, "batches.html", **await self.batches_context())

    async def batches_context(self) -> dict[str, Any]:
        runs = await asyncio.to_thread(read_runs, self.dash.sync, self.dash.keys)
        return {"runs": runs}

    async def batches_sections(self, request: Request) -> dict[str, str]:
        context = await self.batches_context()
        return {"runs": self.dash.fragment(request, "sections/runs.html", **context)}

    async def login(self, request: Request) -> Response:
        if not self.dash.auth.enabled:
            return self.dash.page(
                request,
                "error.html",
                status=404,
                title="Read-only dashboard",
                message="This dashboard was started without an operator key: "
                "there is nothing to log in to.",
            )
        return self.dash.page(request, "login.html", failed=False, next=_local(request))


def _local(request: Request) -> str:
    """The ``next`` page after login: a path of this site only (no open redirect)."""
    target = request.query_params.get("next", "")
    return target if target.startswith("/") and not target.startswith("//") else ""


def _int(text: str | None) -> int:
    try:
        return max(0, int(text or 0))
    except ValueError:
        return 0
