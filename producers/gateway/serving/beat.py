"""The gateway's own heartbeat: ``<prefix>:gateway:alive:<host>:<pid>:<tag>``, with a TTL.

Each gateway process keeps its key alive as a bulk worker does (the same ``Beat`` thread
and default interval and TTL, :mod:`batchd.producers.bulk_liveness`), so the dashboard's
overview lists the gateways alive; the key goes when the gateway stops, or expires a TTL
after it died. The body is JSON: name, host, pid, time of the beat, the batchd version,
the queue it submits to and when it started. The dashboard's probe finds the keys
(batchd.producers.dashboard.fleet.probe); nothing reads them to decide anything.

A beat Redis does not take (unreachable, or an error reply: out of memory, an ACL) is
warned about once per kind of error, not once a second, and said again when a beat is set
(:meth:`Beat.beat`).
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import redis

from batchd import __version__
from batchd.producers.bulk_liveness import Beat, Liveness
from batchd.producers.keys import Keys


def gateway_beat(conn: redis.Redis, keys: Keys, *, queue: str) -> Beat:
    """This app's heartbeat (start it with ``with`` or ``__enter__``; ``stop`` deletes the
    key). The random tag keeps apart two gateway apps of one process."""
    name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    fields = {"name": name, "version": __version__, "queue": queue, "started_at": time.time()}
    return Beat(conn, keys.gateway(name), Liveness(keys.prefix), fields=fields)
