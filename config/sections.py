"""The settings of the producer-side services: ``[gateway]`` and ``[bulk]``.

Kept apart from :mod:`batchd.config.settings` (which holds the engine's options) so that
the gateway and the bulk worker import nothing of the engine; :class:`Settings` has
them as its ``gateway`` and ``bulk`` sections, so they come from the same three layers
(``BATCHD_GATEWAY__MAX_BACKLOG=...``, the TOML file, these defaults). A command's flags
override them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from batchd.config.cluster import is_cluster_url
from batchd.config.limits import NAME_PATTERN, Section
from batchd.config.paths import gateway_files
from batchd.config.sentinel import is_sentinel_url, parse_sentinel_url

RQ_QUEUE = "batchd-bulk"


class QueueSettings(Section):
    """How queues are laid out in Redis; fixed for the life of a deployment's data."""

    partitions: int = Field(1, ge=1, le=64)
    """Partitions of every queue: a job goes to partition crc32(id) mod N, each on its
    own hash slot, so on Redis Cluster one queue spreads over N shards (docs/cluster.md).
    Stored in Redis by the first daemon (<prefix>:layout); a daemon configured otherwise
    refuses to start. Change it only with every queue empty."""


class GatewaySettings(Section):
    """`batchd gateway`, the OpenAI-compatible HTTP gateway. Every bound is per gateway
    process; its flags (--port, --max-in-flight, ...) override these."""

    host: str = Field("127.0.0.1", min_length=1)
    """Address to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """Port to listen on."""
    queue: str = Field("default", pattern=NAME_PATTERN)
    """The batchd queue requests become jobs on."""
    max_in_flight_per_key: int = Field(256, ge=1)
    """Requests in flight per API key (per client address without keys); more get 429."""
    max_backlog: int = Field(1024, ge=0)
    """Jobs waiting unread on the queue above which new requests get 429."""
    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body, counted on the bytes received (chunked or not): 413 past it."""
    max_file_bytes: int = Field(200 << 20, ge=1024)
    """Largest Batch API upload (the file part; the whole body may add 1 MiB of form)."""
    batch_window: int = Field(64, ge=1)
    """Most jobs of one Batch API batch in flight at once."""
    default_max_tokens: int = Field(1024, ge=1)
    """max_tokens of a chat completion or response that gives none (OpenAI's default is
    the rest of the context): held to limits.max_tokens_cap (divided by n) and, when the
    daemons' heartbeats say it, to the model's context length."""
    max_connections: int = Field(4096, ge=1)
    """Open connections and requests above which new requests get 503 at once
    (uvicorn's limit_concurrency): a bound on the gateway's memory."""
    listen_backlog: int = Field(2048, ge=1)
    """Connections the kernel queues before the gateway accepts them."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds a connection has to send a request's headers: a client trickling them is
    cut off (also between requests of a keep-alive connection)."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Seconds a request has to send its whole body (408 past it)."""
    keep_alive_s: int = Field(5, ge=1)
    """Seconds an idle keep-alive connection stays open."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM, seconds open requests and streams get to finish (their jobs are then
    cancelled)."""
    sse_keepalive_s: float = Field(15.0, gt=0)
    """While a streamed job waits in the queue, a comment line is sent this often so
    proxies keep the connection open."""
    redis_max_connections: int = Field(128, ge=2)
    """Connections of the gateway's Redis pool (streams do not hold one each: one reader
    follows every job the gateway answers). A request waits for a free one."""
    redis_pool_timeout_s: float = Field(5.0, gt=0)
    """Longest wait for a free pooled connection before the request gets 503."""
    redis_retry_s: float = Field(3.0, ge=0)
    """How long a Redis command is retried (reconnecting, with a short backoff) before a
    request gets 503: a Redis restart or failover shorter than this fails no request."""
    metrics: bool = True
    """Serve Prometheus metrics at /metrics (on the gateway's port, no key needed)."""
    access_log: bool = True
    """Log one line per request (uvicorn's access log, in log_format)."""


class BulkSettings(Section):
    """Bulk runs (`batchd bulk`), their workers (`batchd bulk-worker`) and the gateway's
    Batch API files."""

    files_dir: Path | None = None
    """The one folder bulk workers read and write: run inputs and outputs, Batch API
    uploads, results, output and error files. `batchd bulk`, `batchd bulk-worker` and
    `batchd gateway` must see the same folder (same host or a shared mount); a worker
    refuses every path outside it. Unset: <state home>/gateway-files (BATCHD_HOME, else
    the user's data folder)."""
    rq_queue: str = Field(RQ_QUEUE, pattern=NAME_PATTERN)
    """The rq queue bulk runs and batches are enqueued on and workers take them from."""
    rq_redis_url: str | None = None
    """The Redis (standalone, or `redis+sentinel://`) holding rq's queue, registries and
    the bulk workers' heartbeats; the batchd jobs of a run still go to the deployment's
    own Redis. Unset: the deployment's URL. Required on Redis Cluster, where rq's workers
    do not run (docs/bulk.md#on-redis-cluster)."""
    window: int = Field(64, ge=1)
    """Most jobs of one `batchd bulk` run in flight at once."""
    fork: bool = True
    """Run each job in a forked work horse (rq's Worker); false runs it in the worker
    process (rq's SimpleWorker; also `batchd bulk-worker --no-fork`)."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """How often a worker, and the process running a job, say they are alive."""
    heartbeat_ttl_s: float = Field(10.0, gt=0)
    """A worker or job runner silent this long counts as dead: the gateway says no worker
    is alive, and the run it held is requeued for another (or a restarted) worker."""
    reap_interval_s: float = Field(5.0, gt=0)
    """How often each worker looks for runs whose runner died, to requeue them."""

    @field_validator("rq_redis_url")
    @classmethod
    def _not_cluster(cls, value: str | None) -> str | None:
        if value is not None and is_cluster_url(value):
            raise ValueError("rq does not run on Redis Cluster: name a standalone or Sentinel one")
        if value is not None and is_sentinel_url(value):
            parse_sentinel_url(value)  # ValueError naming the bad part
        return value

    def folder(self) -> Path:
        """``files_dir``, or its default under batchd's state home."""
        return self.files_dir if self.files_dir is not None else gateway_files()
