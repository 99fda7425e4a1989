"""``batchd gateway``: the OpenAI-compatible HTTP gateway (see batchd.producers.gateway).

Its options are the ``[gateway]`` settings (TOML, ``BATCHD_GATEWAY__*``); a flag given
overrides its setting.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from batchd.config.sections import GatewaySettings
from batchd.config.settings import Settings
from batchd.producers.commands.listen import listen_problem
from batchd.producers.commands.subcommand import add_command

log = logging.getLogger(__name__)

# Keys from the environment (comma-separated) stay out of `ps`.
KEYS_ENV = "BATCHD_GATEWAY_API_KEYS"
# flag dest -> the [gateway] setting it overrides
OVERRIDES = {
    "host": "host",
    "port": "port",
    "queue": "queue",
    "max_in_flight": "max_in_flight_per_key",
    "max_backlog": "max_backlog",
    "max_body_bytes": "max_body_bytes",
    "default_max_tokens": "default_max_tokens",
    "max_connections": "max_connections",
    "header_timeout_s": "header_timeout_s",
}


def register(sub: Any) -> None:
    p = add_command(sub, "gateway", gateway)
    p.add_argument("--host", default=None, help="address to bind (default: gateway.host)")
    p.add_argument("--port", type=int, default=None, help="port (default: gateway.port, 8000)")
    p.add_argument("--queue", default=None, help="batchd queue (default: gateway.queue)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_keys",
        metavar="KEY",
        help="accepted Bearer key (repeatable; none: no auth; an empty key is refused); also "
        "$BATCHD_GATEWAY_API_KEYS (comma-separated)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests in flight per key (default: gateway.max_in_flight_per_key, 256)",
    )
    p.add_argument(
        "--max-backlog",
        type=int,
        default=None,
        help="unread jobs on the queue above which requests get 429 (default: "
        "gateway.max_backlog, 1024)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request body limit, counted as it arrives (default: gateway.max_body_bytes, 4 MiB)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat completion or response that gives none (default: "
        "gateway.default_max_tokens, 1024)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections and requests above which new requests get 503 (default: "
        "gateway.max_connections, 4096)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=None,
        help="seconds a connection has to send its request headers (default: "
        "gateway.header_timeout_s, 10)",
    )
    p.add_argument(
        "--files-dir",
        type=Path,
        default=None,
        help="where Batch API files live, the bulk files folder shared with the bulk worker "
        "(default: bulk.files_dir, else $BATCHD_HOME/gateway-files, else the user's data "
        "folder, e.g. ~/.local/share/batchd/gateway-files)",
    )


def gateway(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the OpenAI HTTP API in front of the batchd fleet.

    Serve /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, the Batch API
    (/v1/files, /v1/batches), /health (/health/live, /health/ready) and /metrics by turning
    requests into batchd jobs on the queue. Batches run on `batchd bulk-worker`, which must
    see --files-dir. Every option is also a [gateway] setting; a flag overrides it.
    """
    # A missing gateway extra is reported by the CLI (batchd.daemon.cli), not here.
    import uvicorn

    from batchd.producers.gateway.app import create_app
    from batchd.producers.gateway.guard import checked_keys, parse_key_list
    from batchd.producers.gateway.options import GatewayOptions
    from batchd.producers.gateway.serving.server import raise_open_files, uvicorn_options

    try:
        keys = checked_keys(args.api_keys + parse_key_list(os.environ.get(KEYS_ENV, "")))
    except ValueError as exc:
        print(f"batchd: gateway: --api-key: {exc}", file=sys.stderr)
        return 2
    try:
        section = gateway_settings(args, settings)
    except ValueError as exc:
        print(f"batchd: gateway: {exc}", file=sys.stderr)
        return 2
    problem = listen_problem(section.host, section.port)
    if problem is not None:
        print(f"batchd: gateway: {problem}", file=sys.stderr)
        return 2
    options = GatewayOptions.from_settings(
        section,
        prefix=settings.key_prefix,
        api_keys=keys,
        files_dir=args.files_dir or settings.bulk.folder(),
        limits=settings.limits,
        rq_queue=settings.bulk.rq_queue,
        rq_redis_url=settings.bulk.rq_redis_url,
    )
    if not keys and not _loopback(section.host):
        log.warning(
            "the gateway listens on %s with no API key: anyone who reaches that address can "
            "run jobs and read every answer; give --api-key (or $%s), or bind 127.0.0.1",
            section.host,
            KEYS_ENV,
        )
    raise_open_files(section)
    app = create_app(settings.connection_url(), options)
    uvicorn.run(app, **uvicorn_options(section, log_level=settings.log_level))
    return 0


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name: only localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def gateway_settings(args: argparse.Namespace, settings: Settings) -> GatewaySettings:
    """The [gateway] section with the flags given on top (validated: ValueError)."""
    given = {OVERRIDES[k]: v for k, v in vars(args).items() if k in OVERRIDES and v is not None}
    try:
        return GatewaySettings.model_validate({**settings.gateway.model_dump(), **given})
    except ValidationError as exc:  # pydantic's multi-line report, as one line per option
        flags = {setting: "--" + arg.replace("_", "-") for arg, setting in OVERRIDES.items()}
        problems = []
        for err in exc.errors():
            name = ".".join(str(part) for part in err["loc"])
            option = f"{flags[name]} (gateway.{name})" if name in flags else f"gateway.{name}"
            problems.append(f"{option} = {err.get('input')!r}: {err['msg']}")
        raise ValueError("; ".join(problems)) from None
