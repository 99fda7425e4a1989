"""``batchd gateway``: the OpenAI-compatible HTTP gateway (see batchd.producers.gateway)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.producers.commands.subcommand import add_command


def register(sub: Any) -> None:
    p = add_command(sub, "gateway", gateway)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--queue", default="default", help="batchd queue (default: default)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_keys",
        metavar="KEY",
        help="accepted Bearer key (repeatable; none: no auth); also $BATCHD_GATEWAY_API_KEYS",
    )
    p.add_argument(
        "--max-in-flight", type=int, default=256, help="requests in flight per key (default 256)"
    )
    p.add_argument(
        "--max-backlog",
        type=int,
        default=1024,
        help="unread jobs on the queue above which requests get 429 (default 1024)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="request body limit (default 4 MiB)"
    )
    p.add_argument(
        "--files-dir",
        type=Path,
        default=Path(".batchd/gateway-files"),
        help="where Batch API files live (shared with the bulk worker)",
    )


def gateway(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the OpenAI HTTP API in front of the batchd fleet.

    Serve /v1/chat/completions, /v1/completions, /v1/models, /health and the Batch API
    (/v1/files, /v1/batches) by turning requests into batchd jobs on --queue. Batches run on
    `batchd bulk-worker`, which must see --files-dir.
    """
    try:
        import uvicorn

        from batchd.producers.gateway.app import create_app
        from batchd.producers.gateway.options import GatewayOptions
    except ImportError as exc:
        print(f"batchd: the gateway needs `pip install 'batchd[gateway]'` ({exc})", file=sys.stderr)
        return 2
    options = GatewayOptions(
        queue=args.queue,
        prefix=settings.key_prefix,
        api_keys=args.api_keys + _env_keys(),
        max_in_flight_per_key=args.max_in_flight,
        max_backlog=args.max_backlog,
        max_body_bytes=args.max_body_bytes,
        files_dir=args.files_dir,
        limits=settings.limits,
    )
    app = create_app(settings.redis_url, options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=settings.log_level.lower())
    return 0


def _env_keys() -> list[str]:
    """Keys from $BATCHD_GATEWAY_API_KEYS (comma-separated): keeps them out of `ps`."""
    return [k for k in os.environ.get("BATCHD_GATEWAY_API_KEYS", "").split(",") if k.strip()]
