"""The daemon's Prometheus series, in a registry of its own.

Counters and histograms are updated on the engine thread as things happen
(a step, a job's end); gauges are set once per loop turn from the engine's
load and the jobs held. prometheus-client locks each series, so the HTTP
thread may scrape at any time. Names follow Prometheus conventions:
``batchd_*_total`` counters, ``_seconds`` in seconds, ratios in 0..1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchd.daemon.ops.observer import StepDone
from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.redis_io import Backoff
from batchd.engine.outputs import StepStats
from batchd.producers.schema import FINAL_STATE, FinishReason

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# A publish is one Redis round trip: the buckets span a local Redis to a distant one.
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)

# The unlabelled counters: name -> help.
COUNTERS = {
    "batchd_jobs_started_total": "Jobs admitted into the engine (resumed included).",
    "batchd_output_tokens_total": "Tokens generated.",
    "batchd_prefill_tokens_total": "Prompt tokens computed (prefix-cache hits excluded).",
    "batchd_preemptions_total": "Sequences preempted for lack of KV blocks.",
    "batchd_speculative_draft_tokens_total": "Tokens proposed by speculative decoding.",
    "batchd_speculative_accepted_tokens_total": "Proposed tokens verified and kept.",
    "batchd_redis_errors_total": "Redis calls that failed (connection, timeout).",
    "batchd_redis_reconnects_total": "Redis outages that ended.",
}
# The histograms: name -> help, buckets.
HISTOGRAMS = {
    "batchd_time_to_first_token_seconds": (
        "From enqueue to the job's first token (resumed jobs are not counted again).",
        LATENCY_BUCKETS,
    ),
    "batchd_inter_token_latency_seconds": (
        "Between consecutive tokens of a job on this daemon.",
        LATENCY_BUCKETS,
    ),
    "batchd_step_duration_seconds": ("One engine step.", LATENCY_BUCKETS),
    "batchd_step_batch_size": ("Sequences packed in one engine step.", BATCH_BUCKETS),
    "batchd_publish_duration_seconds": (
        "The engine thread's time on one publish to Redis: building the pipeline, waiting "
        "for its replies where it waits (an engine on the CPU), applying them.",
        PUBLISH_BUCKETS,
    ),
}
# The gauges set once per loop turn (:meth:`DaemonMetrics.tick`): name -> help.
GAUGES = {
    "batchd_running_sequences": "Sequences in the running batch.",
    "batchd_waiting_sequences": "Sequences waiting for the engine.",
    "batchd_jobs_held": "Jobs this daemon holds (read, not yet acked).",
    "batchd_kv_blocks_used": "KV-cache blocks in use.",
    "batchd_kv_blocks_free": "KV-cache blocks free (cached ones included).",
    "batchd_prefix_cache_hit_ratio": "Prompt tokens found in the prefix cache, since start.",
    "batchd_outbox_events": "Events generated but not yet stored in Redis.",
    "batchd_redis_up": "1 while Redis answers, 0 during an outage.",
}


class DaemonMetrics:
    """Every series the daemon exports; ``registry`` is what the endpoint serves."""

    def __init__(self, *, model: str, consumer: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge(
            "batchd_info",
            "This daemon: model and consumer name.",
            ["model", "consumer"],
            registry=r,
        ).labels(model=model, consumer=consumer).set(1)
        self.jobs = Counter(
            "batchd_jobs_ended_total",
            "Jobs ended here, by final state and finish reason.",
            ["state", "finish_reason"],
            registry=r,
        )
        self.counters = {name: Counter(name, doc, registry=r) for name, doc in COUNTERS.items()}
        self.histograms = {
            name: Histogram(name, doc, buckets=buckets, registry=r)
            for name, (doc, buckets) in HISTOGRAMS.items()
        }
        self.gauges = {name: Gauge(name, doc, registry=r) for name, doc in GAUGES.items()}
        self._backoff_seen = (0, 0)
        # When each running job's last token came, for the inter-token latency.
        self._last_token: dict[str, float] = {}

    def backend(self, name: str, sampler: str, reason: str) -> None:
        """The engine's forward backend, where it samples and why (chosen once at start)."""
        Gauge(
            "batchd_engine_backend_info",
            "The engine's forward backend (mlx, native_cpu), its sampler (device, host) "
            "and why that backend was chosen.",
            ["backend", "sampler", "reason"],
            registry=self.registry,
        ).labels(backend=name, sampler=sampler, reason=reason).set(1)

    def started(self) -> None:
        self.counters["batchd_jobs_started_total"].inc()

    def stepped(self, step: StepDone) -> None:
        """One step: its time, batch, tokens and preemptions; each token's gap to the last,
        or the time to it from enqueue if it is a job's first."""
        now = time.monotonic()
        stats, jobs = step.stats, step.jobs
        self.histograms["batchd_step_duration_seconds"].observe(step.seconds)
        self.histograms["batchd_step_batch_size"].observe(stats.num_seqs)
        self.counters["batchd_prefill_tokens_total"].inc(stats.num_prefill_tokens)
        self.counters["batchd_preemptions_total"].inc(len(stats.preempted))
        self.counters["batchd_speculative_draft_tokens_total"].inc(stats.num_draft_tokens)
        self.counters["batchd_speculative_accepted_tokens_total"].inc(stats.num_accepted_tokens)
        for out in step.outputs:
            job_id = out.request_id
            if out.error is None:
                self.counters["batchd_output_tokens_total"].inc()
                last = self._last_token.get(job_id)
                if last is not None:
                    self.histograms["batchd_inter_token_latency_seconds"].observe(now - last)
                self._first_token(jobs.get(job_id))
                self._last_token[job_id] = now
            if out.finish_reason is not None:
                self._last_token.pop(job_id, None)

    def published(self, seconds: float) -> None:
        self.histograms["batchd_publish_duration_seconds"].observe(seconds)

    def finished(self, job: Job) -> None:
        reason = job.finish_reason or FinishReason.error  # a finished job always has one
        self.jobs.labels(state=FINAL_STATE[reason].value, finish_reason=reason.value).inc()
        self._last_token.pop(job.job_id, None)

    def tick(self, stats: StepStats, jobs: Mapping[str, Job], backoff: Backoff) -> None:
        """Gauges from the engine's load after its last step, the jobs held and the Redis
        connection."""
        values = {
            "batchd_running_sequences": stats.num_running,
            "batchd_waiting_sequences": stats.num_waiting,
            "batchd_jobs_held": len(jobs),
            "batchd_kv_blocks_used": stats.kv_blocks_used,
            "batchd_kv_blocks_free": stats.kv_blocks_total - stats.kv_blocks_used,
            "batchd_prefix_cache_hit_ratio": stats.prefix_cache_hit_rate,
            "batchd_outbox_events": _outbox(jobs.values()),
            "batchd_redis_up": 0 if backoff.down else 1,
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        errors, reconnects = self._backoff_seen
        self.counters["batchd_redis_errors_total"].inc(backoff.errors_total - errors)
        self.counters["batchd_redis_reconnects_total"].inc(backoff.reconnects_total - reconnects)
        self._backoff_seen = (backoff.errors_total, backoff.reconnects_total)
        if len(self._last_token) > len(jobs):  # jobs dropped without an end (lost to another)
            self._last_token = {k: v for k, v in self._last_token.items() if k in jobs}

    def _first_token(self, job: Job | None) -> None:
        if job is not None and not job.output_token_ids and job.timings.queued is not None:
            ttft = max(0.0, time.time() - job.timings.queued)
            self.histograms["batchd_time_to_first_token_seconds"].observe(ttft)


def _outbox(jobs: Iterable[Job]) -> int:
    return sum(len(job.unpublished) for job in jobs)
