"""What every handler of one dashboard shares: its Redis clients, templates and rules.

One :class:`Dashboard` per app; handlers (:mod:`.pages`, :mod:`.actions`, :mod:`.live`)
take it, so that none of them reaches for a global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import redis
import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import HTMLResponse

from batchd.producers.aio import AsyncClient
from batchd.producers.dashboard.auth import Operator, OperatorAuth
from batchd.producers.dashboard.fleet.sampler import Sampler
from batchd.producers.dashboard.options import DashboardOptions
from batchd.producers.dashboard.records.audit import Audit
from batchd.producers.keys import Keys

# The navigation: (name, path, label).
PAGES: tuple[tuple[str, str, str], ...] = (
    ("overview", "", "Overview"),
    ("jobs", "/jobs", "Jobs"),
    ("dead", "/dead", "Dead letters"),
    ("batches", "/batches", "Batches"),
)


@dataclass
class Dashboard:
    options: DashboardOptions
    client: AsyncClient
    sync: redis.Redis
    env: jinja2.Environment
    auth: OperatorAuth
    audit: Audit
    sampler: Sampler

    @property
    def keys(self) -> Keys:
        """The deployment's key names: the sampler's, which follows the stored layout."""
        return self.sampler.prober.keys

    @property
    def redis(self) -> aioredis.Redis:
        return self.client.redis

    def operator(self, request: Request) -> Operator | None:
        return self.auth.operator(request)

    def page(
        self, request: Request, template: str, *, status: int = 200, **context: Any
    ) -> HTMLResponse:
        """A full page: the template with what the layout needs (operator, links)."""
        html = self.env.get_template(template).render(**self.common(request), **context)
        return HTMLResponse(html, status_code=status)

    def fragment(self, request: Request | None, template: str, **context: Any) -> str:
        """A template rendered alone (a live section)."""
        common = self.common(request) if request is not None else {}
        return self.env.get_template(template).render(**{**common, **context})

    def common(self, request: Request | None) -> dict[str, Any]:
        operator = self.operator(request) if request is not None else None
        return {
            "root": request.scope.get("root_path", "") if request is not None else "",
            "operator": operator,
            "auth_enabled": self.auth.enabled,
            "pages": PAGES,
        }
