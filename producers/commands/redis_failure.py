"""What a command says when Redis fails it: one line naming the cause and the fix.

redis-py's messages name the symptom only ("Connection refused", "DB index is out of
range", a Sentinel error with the pool's repr); a new user needs to know which setting to
change. Every command that talks to Redis turns a failure into :func:`explain` and exits
with :data:`REDIS_EXIT` (docs/troubleshooting.md lists the messages).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from redis.exceptions import RedisClusterException

from batchd.config.secrets import redact

# Exit code of a command that Redis failed (unreachable, refused the login, no such
# database...): distinct from 1 (the job failed) and 2 (the command line or settings).
REDIS_EXIT = 3
# What a command may catch as "Redis failed it": RedisClusterException is no RedisError.
REDIS_FAILURES: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
_URL_HINT = "--redis-url (or $BATCHD_REDIS_URL, or redis_url in the config file)"


def explain(exc: Exception, url: str) -> str:
    """One line for ``exc``, raised while talking to Redis at ``url`` (passwords hidden)."""
    where = redact(url)
    # A Sentinel error appends its connection pool's repr after " : ": noise to a reader.
    text = redact(str(exc)).partition(" : <")[0].strip().rstrip(".")
    lowered = text.lower()
    if isinstance(exc, redis.AuthenticationError) or "wrongpass" in lowered or "noauth" in lowered:
        return (
            f"Redis at {where} refused the login ({text}): give the right user and password "
            f"in the URL, redis://USER:PASSWORD@HOST:PORT/DB, with {_URL_HINT}"
        )
    if "db index is out of range" in lowered:
        return (
            f"Redis at {where} has no database {_db(url)} ({text}): use a database number "
            "below the server's `databases` setting (16 by default) at the end of the URL"
        )
    if "cluster mode is not enabled" in lowered:
        return (
            f"cannot use {where} as a Redis Cluster ({text}): a redis+cluster:// URL needs "
            "a server started with cluster-enabled yes; for a single server use redis://"
        )
    if "sentinel" in url.split("://", 1)[0]:
        return (
            f"no Sentinel listed in {where} answered for its master ({text}): check that the "
            "Sentinels run at those addresses and that the master's name is the one they "
            f"monitor; set {_URL_HINT}"
        )
    if isinstance(exc, redis.ResponseError):
        return f"Redis at {where} refused a command: {text}"
    tls = " (a rediss:// URL speaks TLS: use redis:// if the server does not)"
    return (
        f"cannot reach Redis at {where}: {text}{tls if url.startswith('rediss') else ''}; "
        f"start redis-server there, or point {_URL_HINT} at a running one"
    )


def _db(url: str) -> str:
    """The database number a redis:// URL names (its path), for the message."""
    path = urlsplit(url).path.strip("/")
    return path or "0"
