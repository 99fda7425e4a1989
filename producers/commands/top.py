"""``batchd top``: the live fleet view as a command (see batchd.producers.top)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from batchd.config.settings import Settings
from batchd.producers.commands.redis_failure import REDIS_EXIT, REDIS_FAILURES, explain
from batchd.producers.commands.subcommand import add_command
from batchd.producers.connection import read_layout, redis_client
from batchd.producers.keys import Keys
from batchd.producers.top import CLEAR, render, snapshot_json, take_snapshot


def register(sub: Any) -> None:
    p = add_command(sub, "top", top)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print JSON (one line per snapshot)")
    p.add_argument(
        "--interval", type=_positive, default=1.0, metavar="SECONDS", help="refresh period"
    )


def top(args: argparse.Namespace, settings: Settings) -> int:
    """Live view of daemons and queues.

    Show every live daemon (from its heartbeat: model, queues, running and waiting jobs, KV
    usage, tokens/s) and every queue (length, unread, pending, consumers), refreshed every
    --interval seconds until Ctrl-C.
    """
    client = redis_client(settings.connection_url(), socket_connect_timeout=5, socket_timeout=5)
    kept: Keys | None = None  # the layout, once a daemon has stored it
    clear = not args.json and not args.once and sys.stdout.isatty()
    try:
        while True:
            try:
                keys, stored = (kept, True) if kept else read_layout(client, settings.key_prefix)
                kept = keys if stored else None
                snapshot = take_snapshot(client, keys)
                text = snapshot_json(snapshot) if args.json else render(snapshot)
            except REDIS_FAILURES as exc:
                print(f"batchd: {explain(exc, settings.connection_url())}", file=sys.stderr)
                if args.once:
                    return REDIS_EXIT
                text = ""
            sys.stdout.write((CLEAR if clear else "") + text)
            sys.stdout.flush()
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value
