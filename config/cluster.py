"""A Redis Cluster: its URL, parsed.

redis-py's ``RedisCluster.from_url`` takes one node; a deployment is better named by
several, so that a client starts while any one of them is down. batchd takes the form
of its Sentinel URL (:mod:`batchd.config.sentinel`)::

    redis+cluster://[user:password@]host[:port][,host[:port]...][?options]
    rediss+cluster://...   TLS to every node

Nodes default to port 6379; the client learns the rest of the cluster from them. The
options are redis-py URL options of every node's connections (``ssl_ca_certs``, ...).
A cluster has database 0 only. The connection is made by :mod:`batchd.producers.connection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.connection import parse_url

from batchd.config.secrets import redact
from batchd.config.sentinel import host_port, split_url

# Scheme -> TLS.
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
DEFAULT_CLUSTER_PORT = 6379


@dataclass(frozen=True)
class ClusterTarget:
    """A parsed ``redis+cluster://`` URL: the nodes to start from, and the keywords of
    every node's connections (credentials, TLS, URL options)."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    options: dict[str, Any] = field(default_factory=dict)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (by its scheme only)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterTarget:
    """The cluster a ``redis+cluster://`` URL names; ValueError (the URL shown without
    its password) when it has no node, a bad address, or a database other than 0."""
    tls, userinfo, hosts, path, query = split_url(url, CLUSTER_SCHEMES)
    try:
        if path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has database 0 only")
        nodes = tuple(host_port(part, DEFAULT_CLUSTER_PORT) for part in hosts.split(",") if part)
        if not nodes:
            raise ValueError("no node address")
        credentials = f"{userinfo}@" if userinfo else ""
        options = dict(parse_url(f"redis://{credentials}node/0?{query}"))
    except ValueError as exc:
        raise ValueError(f"{redact(url)}: {exc}") from None
    for name in ("host", "port", "db"):
        options.pop(name, None)
    if tls:
        options["ssl"] = True
    return ClusterTarget(nodes, tls, options)
