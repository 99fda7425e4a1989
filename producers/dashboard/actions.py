"""The actions (POST): log in and out, cancel a job, re-drive letters, control a daemon.

Every action is checked by :meth:`OperatorAuth.require` first (401 without an operator,
403 for a refused key, a forged or cross-origin request) and recorded by the audit
trail after, whatever its outcome. A browser's form gets a redirect (303) back to the
page it came from; a script (Bearer key, or ``Accept: application/json``) gets JSON.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from markupsafe import escape
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from batchd.producers.dashboard.auth import COOKIE, CSRF_FIELD, Operator, Refused, same_origin
from batchd.producers.dashboard.context import Dashboard
from batchd.producers.dashboard.records.controls import ControlRefused, request_control
from batchd.producers.dashboard.records.dead import Redriven, read_letter, redrive
from batchd.producers.errors import JobNotFound
from batchd.producers.keys import is_name

log = logging.getLogger(__name__)

# At most this many letters re-driven by one request.
MAX_REDRIVE = 500
MAX_NOTE_CHARS = 500
# A refused login answers this much later: a key cannot be guessed at network speed.
LOGIN_PENALTY_S = 0.5


class Actions:
    """The POST handlers of one dashboard."""

    def __init__(self, dash: Dashboard) -> None:
        self.dash = dash

    async def login(self, request: Request) -> Response:
        form = await request.form()
        key = str(form.get("key") or "")
        target = str(form.get("next") or "")
        root = request.scope.get("root_path", "")
        matched = self.dash.auth.matching_key(key) if same_origin(request) else None
        if matched is None:
            await self.dash.audit.record(
                operator="-", action="login", target="dashboard", outcome="refused"
            )
            await asyncio.sleep(LOGIN_PENALTY_S)
            return self.dash.page(request, "login.html", status=403, failed=True, next=target)
        session = self.dash.auth.new_session(matched)
        operator = self.dash.auth.session(session)
        response = RedirectResponse(_local(target) or f"{root}/", status_code=303)
        response.set_cookie(
            COOKIE,
            session,
            max_age=int(self.dash.options.session_ttl_s),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=root or "/",
        )
        who = operator.id if operator else "-"
        await self.dash.audit.record(operator=who, action="login", target="dashboard", outcome="ok")
        return response

    async def logout(self, request: Request) -> Response:
        root = request.scope.get("root_path", "")
        response = RedirectResponse(f"{root}/", status_code=303)
        if same_origin(request):
            response.delete_cookie(COOKIE, path=root or "/")
        return response

    async def cancel(self, request: Request) -> Response:
        operator, form = await self._operator(request)
        job_id = request.path_params["job_id"]
        if not is_name(job_id):
            return _answer(request, {"error": "no such job"}, status=404)
        try:
            requested = await self.dash.client.cancel(job_id)
            outcome = "requested" if requested else "already ended"
        except JobNotFound:
            outcome = "no such job"
        await self.dash.audit.record(
            operator=operator.id, action="cancel", target=job_id, outcome=outcome
        )
        status = 404 if outcome == "no such job" else 200
        root = request.scope.get("root_path", "")
        where = f"{root}/jobs/{job_id}?done=cancel"
        return _answer(request, {"job": job_id, "outcome": outcome}, status=status, where=where)

    async def redrive(self, request: Request) -> Response:
        operator, form = await self._operator(request)
        only = form.get("only")  # a row's own button: that letter alone
        entries = [str(only)] if only else [str(e) for e in form.getlist("entry")][:MAX_REDRIVE]
        note = str(form.get("note") or "")[:MAX_NOTE_CHARS].strip()
        results = [await self._redrive_one(entry, operator, note) for entry in entries]
        done = [r for r in results if r.job_id]
        root = request.scope.get("root_path", "")
        body: dict[str, Any] = {
            "redriven": [{"entry": r.entry, "job": r.job_id, "before": r.before} for r in done],
            "refused": [{"entry": r.entry, "error": r.error} for r in results if not r.job_id],
        }
        where = f"{root}/dead?redriven={len(done)}"
        return _answer(request, body, status=200 if entries else 400, where=where)

    async def control(self, request: Request) -> Response:
        operator, form = await self._operator(request)
        consumer = request.path_params["consumer"]
        action = str(form.get("action") or "")
        try:
            await request_control(
                self.dash.redis, self.dash.keys, consumer, action, operator=operator.id
            )
            outcome, status = "requested", 200
        except ControlRefused as exc:
            outcome, status = f"refused: {exc}", 409
        await self.dash.audit.record(
            operator=operator.id, action=f"daemon {action}", target=consumer, outcome=outcome
        )
        root = request.scope.get("root_path", "")
        body = {"daemon": consumer, "action": action, "outcome": outcome}
        return _answer(request, body, status=status, where=f"{root}/")

    async def _operator(self, request: Request) -> tuple[Operator, Any]:
        """The request's operator and form; raises Refused (before reading the body when
        no credentials came at all)."""
        if self.dash.auth.operator(request) is None:
            self.dash.auth.require(request, None)  # raises the right 401 / 403
        form = await request.form()
        token = form.get(CSRF_FIELD)
        return self.dash.auth.require(request, str(token) if token else None), form

    async def _redrive_one(self, entry: str, operator: Operator, note: str) -> Redriven:
        letter = await read_letter(self.dash.redis, self.dash.keys, entry, self.dash.options.limits)
        if letter is None:
            result = Redriven(entry, None, "no such dead letter")
        else:
            result = await redrive(
                self.dash.client, self.dash.keys, letter, operator=operator.id, note=note
            )
        outcome = f"new job {result.job_id}" if result.job_id else f"refused: {result.error}"
        if result.before:
            outcome = f"already re-driven as {result.job_id}"
        target = f"{letter.job_id if letter else '?'} (letter {entry})"
        await self.dash.audit.record(
            operator=operator.id, action="redrive", target=target, outcome=outcome, note=note
        )
        return result


def _answer(
    request: Request, body: dict[str, Any], *, status: int, where: str | None = None
) -> Response:
    """JSON for a script; a redirect to ``where`` for a browser's form."""
    wants_json = "application/json" in request.headers.get("accept", "")
    if wants_json or where is None or request.headers.get("authorization"):
        return JSONResponse(body, status_code=status)
    return RedirectResponse(where, status_code=303)


def refused(request: Request, exc: Refused) -> Response:
    """The answer to a refused action: 401 or 403, as JSON or a short page."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if "text/html" in request.headers.get("accept", ""):
        root = request.scope.get("root_path", "")
        text = (
            f"<!doctype html><title>{exc.status}</title><p>{escape(exc.reason)}. "
            f'<a href="{escape(root)}/login">Log in</a></p>'
        )
        return HTMLResponse(text, status_code=exc.status, headers=headers)
    return JSONResponse({"error": exc.reason}, status_code=exc.status, headers=headers)


def _local(target: str) -> str:
    return target if target.startswith("/") and not target.startswith("//") else ""
