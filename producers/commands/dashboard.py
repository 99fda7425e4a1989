"""``batchd dashboard``: the web dashboard (see batchd.producers.dashboard)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.producers.commands.extras import install_command
from batchd.producers.commands.listen import listen_problem
from batchd.producers.commands.subcommand import add_command

# Keys from the environment (comma-separated) or a file (one per line) stay out of `ps`.
KEYS_ENV = "BATCHD_DASHBOARD_OPERATOR_KEYS"
GATEWAY_KEYS_ENV = "BATCHD_GATEWAY_API_KEYS"


def register(sub: Any) -> None:
    p = add_command(sub, "dashboard", dashboard)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    p.add_argument("--queue", default="default", help="queue of re-driven jobs without one")
    p.add_argument(
        "--operator-key",
        action="append",
        default=[],
        dest="operator_keys",
        metavar="KEY",
        help="key that allows actions (repeatable; at least 16 characters; none: read-only); "
        f"also ${KEYS_ENV} (comma-separated)",
    )
    p.add_argument(
        "--operator-key-file",
        type=Path,
        metavar="FILE",
        help="file of operator keys, one per line",
    )
    p.add_argument(
        "--private",
        action="store_true",
        help="every page needs an operator login, not only the actions",
    )
    p.add_argument(
        "--refresh", type=float, default=1.0, metavar="SECONDS", help="overview refresh period"
    )
    p.add_argument(
        "--no-latency",
        action="store_true",
        help="do not subscribe to token channels (no TTFT/ITL charts; for a very busy fleet)",
    )


def dashboard(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the web dashboard: queues, daemons, jobs, dead letters and batches, live.

    Serve a browser view of the fleet read from Redis alone: the overview (queues,
    daemons, throughput and latency charts), any job with its tokens streaming in, the
    dead letters, Batch API batches and bulk runs. Reading is open; cancelling a job,
    re-driving a dead letter and controlling a daemon need an operator key, which must not
    be a gateway API key.
    """
    try:
        import uvicorn

        from batchd.producers.dashboard.app import create_app
        from batchd.producers.dashboard.options import DashboardOptions
        from batchd.producers.gateway.guard import parse_key_list
    except ImportError as exc:
        print(
            f"batchd: the dashboard needs the gateway extra: {install_command(['gateway'])}; {exc}",
            file=sys.stderr,
        )
        return 2
    keys = list(args.operator_keys) + parse_key_list(os.environ.get(KEYS_ENV, ""))
    if args.operator_key_file is not None:
        try:
            text = args.operator_key_file.read_text()
        except OSError as exc:
            print(f"batchd: dashboard: --operator-key-file: {exc}", file=sys.stderr)
            return 2
        keys += [line.strip() for line in text.splitlines() if line.strip()]
    gateway_keys = set(parse_key_list(os.environ.get(GATEWAY_KEYS_ENV, "")))
    if gateway_keys & set(keys):
        print("batchd: dashboard: an operator key must not be a gateway API key", file=sys.stderr)
        return 2
    try:
        options = DashboardOptions(
            prefix=settings.key_prefix,
            queue=args.queue,
            operator_keys=tuple(dict.fromkeys(keys)),
            private=args.private,
            refresh_s=args.refresh,
            latency=not args.no_latency,
            limits=settings.limits,
        )
    except ValueError as exc:
        print(f"batchd: dashboard: {exc}", file=sys.stderr)
        return 2
    problem = listen_problem(args.host, args.port)
    if problem is not None:
        print(f"batchd: dashboard: {problem}", file=sys.stderr)
        return 2
    app = create_app(settings.connection_url(), options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=settings.log_level.lower())
    return 0
