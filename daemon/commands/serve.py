"""``batchd serve``: load the model and run the worker daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from batchd.config.settings import Settings, default_consumer_name
from batchd.engine.models.registry import PRESET_NAMES
from batchd.producers.commands.subcommand import add_command, add_model_option

if TYPE_CHECKING:  # imported when serving: prometheus-client and MLX only then
    from batchd.daemon.ops.prom import DaemonMetrics

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = add_command(sub, "serve", run)
    add_model_option(
        p,
        help="model to serve: a preset (" + ", ".join(PRESET_NAMES) + "), an mlx-lm "
        "directory, a hub id or a .gguf file (converted once into the model cache); "
        "--preset is the same option (default: the setting model)",
    )
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
        "--adapter",
        action="append",
        dest="adapters",
        type=_adapter,
        metavar="NAME=PATH",
        help="serve the LoRA adapter directory PATH as NAME (repeatable; added to "
        "engine.adapters): jobs name it in their adapter field, the gateway as model "
        "<model>:NAME",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://<daemon.metrics_addr>:PORT/metrics "
        "(default: daemon.metrics_port; unset: off)",
    )


def apply_args(settings: Settings, args: argparse.Namespace) -> Settings:
    """Settings with the serve flags on top (flags win over env and file)."""
    update: dict[str, Any] = {}
    if args.model:
        update["model"] = args.model
    if args.queues:
        update["queues"] = args.queues
    daemon: dict[str, Any] = {}
    if args.consumer_name:
        daemon["consumer_name"] = args.consumer_name
    if args.metrics_port is not None:
        daemon["metrics_port"] = args.metrics_port
    if daemon:
        update["daemon"] = settings.daemon.model_copy(update=daemon)
    if args.adapters:
        adapters = {**settings.engine.adapters, **dict(args.adapters)}
        update["engine"] = dataclasses.replace(settings.engine, adapters=adapters)
    return settings.model_copy(update=update)


def _adapter(value: str) -> tuple[str, str]:
    """``NAME=PATH`` of --adapter."""
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH")
    return name, path


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run the worker daemon: jobs from Redis streams in, tokens out.

    Join the consumer group of each queue, run jobs through the engine and publish every token.
    SIGTERM/SIGINT: stop taking jobs, let running ones finish within daemon.grace_period_s,
    leave the rest pending; a second signal stops at once.
    """
    settings = apply_args(settings, args)
    if not settings.model:
        print(
            "batchd serve: no model: give --model (or --preset) or set model / BATCHD_MODEL",
            file=sys.stderr,
        )
        return 2
    consumer = settings.daemon.consumer_name or default_consumer_name()
    log.info(
        "batchd serve starting: model %s, queues %s",
        settings.model,
        settings.queues,
        extra={"event": "daemon_starting", "consumer": consumer, "pid": os.getpid()},
    )
    from batchd.daemon.commands.load_failure import LOAD_FAILURES, explain
    from batchd.daemon.fleet.heartbeat import ConsumerTaken
    from batchd.daemon.ops.observer import Ops
    from batchd.daemon.ops.prom import DaemonMetrics
    from batchd.daemon.worker.loop import Worker
    from batchd.daemon.worker.mlx_generator import MLXGenerator
    from batchd.daemon.worker.redis_io import ClusterUrlNeeded
    from batchd.engine.models.registry import resolve_model
    from batchd.producers.commands.redis_failure import REDIS_EXIT, REDIS_FAILURES
    from batchd.producers.commands.redis_failure import explain as explain_redis
    from batchd.producers.connection.layout import LayoutError

    metrics = None
    if settings.daemon.metrics_port is not None:
        metrics = DaemonMetrics(model=settings.model, consumer=consumer)
        if not _serve_metrics(settings, metrics):
            return 2

    began = time.monotonic()
    try:
        model = resolve_model(settings.model)
        generator = MLXGenerator.from_pretrained(model, settings.engine)
    except LOAD_FAILURES as exc:
        print(f"batchd serve: cannot load model: {explain(settings.model, exc)}", file=sys.stderr)
        return 2
    log.info(
        "model %s loaded in %.1fs",
        settings.model,
        time.monotonic() - began,
        extra={"event": "model_loaded"},
    )
    if metrics is not None:
        choice = generator.engine.backend
        metrics.backend(choice.name, choice.sampler, choice.reason)
    ops = Ops.for_service(settings, metrics=metrics)
    worker = Worker(settings, generator, consumer=consumer, ops=ops)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.request_stop())
    try:
        worker.run()
    except (ClusterUrlNeeded, LayoutError, ConsumerTaken) as exc:
        print(f"batchd serve: {exc}", file=sys.stderr)
        ops.failed(exc)
        return 2
    except REDIS_FAILURES as exc:
        # Outages are ridden out inside the worker; what reaches here is Redis refusing the
        # settings (no such database, not a cluster): the fix is the URL, not our code.
        print(f"batchd serve: {explain_redis(exc, settings.connection_url())}", file=sys.stderr)
        log.debug("redis failure", exc_info=exc)
        ops.failed(exc)
        return REDIS_EXIT
    except Exception as exc:
        # Exit non-zero so that the supervisor restarts us (Restart=on-failure, KeepAlive):
        # the jobs held stay pending and are taken back from their events streams.
        log.exception("daemon failed: %s", exc, extra={"event": "daemon_failed"})
        ops.failed(exc)
        return 1
    log.info("stopped", extra={"event": "stopped"})
    return 0


def _serve_metrics(settings: Settings, metrics: DaemonMetrics) -> bool:
    """Start the metrics endpoint; False (said on stderr) when its address is unusable."""
    from batchd.producers.telemetry import serve_metrics

    addr, port = settings.daemon.metrics_addr, settings.daemon.metrics_port
    assert port is not None
    try:
        serve_metrics(port, addr=addr, registry=metrics.registry)
    except OSError as exc:
        print(
            f"batchd serve: cannot serve metrics on {addr}:{port} "
            f"(daemon.metrics_port / --metrics-port, daemon.metrics_addr): {exc}",
            file=sys.stderr,
        )
        return False
    return True
