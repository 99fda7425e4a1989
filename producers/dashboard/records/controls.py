"""Asking a daemon to pause its intake, resume it, or drain (finish its jobs and stop).

The request is a hash, ``<prefix>:control:<consumer>`` (``intake`` = paused | open,
``drain`` = 0 | 1, ``at``, ``by``), which a daemon reads on its own schedule; a daemon
announces the controls it obeys in its heartbeat (``controls``: a list of names). The
dashboard offers, and accepts, only the controls the live daemon announces: a request
no daemon would read is refused rather than shown as done.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchd.producers.dashboard.records.names import control
from batchd.producers.keys import Keys

ACTIONS: dict[str, dict[str, str]] = {
    "pause": {"intake": "paused"},
    "resume": {"intake": "open", "drain": "0"},
    "drain": {"drain": "1"},
}


class ControlRefused(Exception):
    """The daemon is not live, or does not announce this control."""


async def request_control(
    client: aioredis.Redis, keys: Keys, consumer: str, action: str, *, operator: str
) -> dict[str, str]:
    """Write the control request for a live daemon that announces ``action``; the fields
    written. Raises ControlRefused."""
    if action not in ACTIONS:
        raise ControlRefused(f"unknown control {action!r}")
    raw = await client.get(keys.daemon(consumer))
    beat: Any = orjson.loads(raw) if raw else None
    if not isinstance(beat, dict):
        raise ControlRefused(f"daemon {consumer!r} is not live")
    offered = beat.get("controls")
    if not isinstance(offered, list) or action not in offered:
        raise ControlRefused(f"daemon {consumer!r} does not announce the control {action!r}")
    fields: dict[Any, Any] = {**ACTIONS[action], "at": f"{time.time():.3f}", "by": operator}
    await client.hset(control(keys, consumer), mapping=fields)
    return fields
