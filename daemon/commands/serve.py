"""``batchd serve``: load the model and run the worker daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from config import Settings
from config.settings import default_consumer_name

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the worker daemon: jobs from Redis streams in, tokens out",
        description="Join the consumer group of each queue, run jobs through the engine and "
        "publish every token. SIGTERM/SIGINT: stop taking jobs, let running ones finish "
        "within daemon.grace_period_s, leave the rest pending; a second signal stops at once.",
    )
    p.add_argument("--model", metavar="PATH_OR_HUB_ID", help="model to serve (default: model)")
    p.add_argument(
        "--queue",
        action="append",
        dest="queues",
        metavar="NAME",
        help="queue to consume (repeatable; default: queues)",
    )
    p.add_argument(
        "--consumer-name",
        metavar="NAME",
        help="stable consumer name (default: daemon.consumer_name, else host:pid)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="TOML settings file (same as batchd --config FILE)",
    )
    p.set_defaults(func=run)


def apply_args(settings: Settings, args: argparse.Namespace) -> Settings:
    """Settings with the serve flags on top (flags win over env and file)."""
    update: dict[str, Any] = {}
    if args.model:
        update["model"] = args.model
    if args.queues:
        update["queues"] = args.queues
    if args.consumer_name:
        update["daemon"] = settings.daemon.model_copy(update={"consumer_name": args.consumer_name})
    return settings.model_copy(update=update)


def run(args: argparse.Namespace, settings: Settings) -> int:
    settings = apply_args(settings, args)
    if not settings.model:
        print("batchd serve: no model: give --model or set model / BATCHD_MODEL", file=sys.stderr)
        return 2
    consumer = settings.daemon.consumer_name or default_consumer_name()
    from daemon.worker.loop import Worker
    from daemon.worker.mlx_generator import MLXGenerator

    log.info("loading model %s", settings.model)
    try:
        generator = MLXGenerator.from_pretrained(settings.model, settings.engine)
    except (OSError, ValueError) as exc:
        print(f"batchd serve: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    worker = Worker(settings, generator, consumer=consumer)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.request_stop())
    worker.run()
    log.info("stopped")
    return 0
