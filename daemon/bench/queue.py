"""The queue workload: the mixed requests through Redis against the engine in-process.

Producers submit every job onto a stream, a ``batchd serve`` daemon (a
separate process, as in production) runs them on its engine and publishes
every token, and one subscriber follows all the jobs' event streams. The same
engine settings driven in-process give the reference; the ratio (output tok/s
through the queue over in-process) is the queue layer's cost.

Both sides do the same work: the same requests, the same engine settings (KV
pool included), a fresh engine warmed up on the same warm-up requests, model
loading outside the timing, the clock running from the first request's
arrival (its submit, for the queue) to the last output token (as the
subscriber receives it). The subscriber stands for the daemon's clients,
which run on other machines: it runs at the lowest CPU priority
(batchd.daemon.bench.subscriber), so that on a small shared host it takes the cores
the engine leaves rather than stalling its steps. A shared machine's load
drifts over minutes, and a noisy neighbour moves one short run by as much,
so the runs alternate: in-process, queue, in-process, ...; each
queue run is divided by the mean of the two in-process runs around it, and
the reported ratio is
the median of those (best-of, the fastest queue run over the fastest
in-process run, is reported too). Rounds go on until at least MIN_ROUNDS
have run and the rounds have taken ROUNDS_BUDGET_S, at most MAX_ROUNDS: a
model whose run takes 10 s (bench-small) gets a median of ~8, one whose run
takes 45 s (SmolLM2) a median of 3 (``rounds`` fixes the count instead). The budget
was sized from how far one round's ratio spreads on a 2-core shared host
(docs/bench/HISTORY.md, "Figures behind the code's choices").
Every queue round starts a fresh daemon under its own key prefix, deleted
afterwards, so no prefix cache carries over from a previous round. Besides
the client's CPU time, each queue run records what Redis spent (``INFO
cpu``): the two processes that share the machine with the daemon; and, read
from the daemon's metrics endpoint, how long its engine thread spent on
publishing against its engine steps: the queue's own cost inside the daemon.

The queue side may run ``daemons`` daemons at once (the in-process reference stays one
engine), on a queue of ``partitions`` partitions, on any Redis URL a daemon takes,
``redis+cluster://`` included: the figures are then the fleet's (tokens published, jobs
submitted a second) and Redis's CPU is summed over the cluster's primaries. That is the
measure of the queue path's capacity a Cluster is for (docs/cluster.md). Each primary's
CPU seconds and commands are reported too (``redis_servers``): whether the work splits
over the shards, or is repeated on each, shows only there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from batchd.config.secrets import redact
from batchd.daemon.bench.engine_system import bench_engine_config
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.stats import Recorder, RunStats
from batchd.daemon.bench.subscriber import run_as_subscriber
from batchd.daemon.bench.systems import BATCHD, Systems, SystemUnavailable, longest_request
from batchd.daemon.bench.workloads import Workload
from batchd.daemon.redis_server import free_port
from batchd.producers.client import Client, follow
from batchd.producers.connection.factory import is_cluster, redis_client
from batchd.producers.errors import BatchdError
from batchd.producers.keys import Keys

_SERVE_MODULE = "batchd.daemon.commands.serve"
_QUEUE = "bench"
_PREFIX = "batchd-bench"
_START_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 30.0
MIN_ROUNDS = 3
MAX_ROUNDS = 11
ROUNDS_BUDGET_S = 240.0
METHOD = (
    "in-process and queue runs alternate; each queue run over the mean of the in-process "
    "runs before and after it; ratio = median over rounds"
)


class QueueUnavailable(RuntimeError):
    """The queue run could not happen; the message says why (for the report)."""


def daemon_unavailable(redis_url: str) -> str | None:
    """Why the queue workload cannot run here, or None when it can."""
    if importlib.util.find_spec(_SERVE_MODULE) is None:
        return "not available: daemon missing"
    try:
        with redis_client(redis_url, socket_connect_timeout=2) as conn:
            conn.ping()
    except redis.RedisError as exc:
        return f"not available: no Redis at {redact(redis_url)} ({exc})"
    return None


def run_queue(
    systems: Systems,
    workload: Workload,
    *,
    redis_url: str,
    progress: Progress,
    rounds: int | None = None,
    daemons: int = 1,
    partitions: int = 1,
) -> dict[str, Any]:
    """In-process and through Redis, alternating (see the module doc); the ratios.
    ``rounds`` None: as many as the time budget allows (MIN_ROUNDS..MAX_ROUNDS).
    ``daemons`` daemons serve a queue of ``partitions`` partitions."""
    reason = daemon_unavailable(redis_url)
    in_process: list[RunStats] = []
    if reason is None:
        try:
            in_process.append(systems.offline(BATCHD, workload))
        except SystemUnavailable as exc:
            reason = f"not available: {exc}"
    if reason is not None:
        progress.say(f"queue: {reason}")
        return {"available": False, "reason": reason}
    queued: list[dict[str, Any]] = []
    began = time.monotonic()
    while _another_round(len(queued), time.monotonic() - began, rounds):
        try:
            stats, cpu = _run_through_daemon(
                systems,
                workload,
                redis_url,
                progress,
                prefix=f"{_PREFIX}-{os.getpid()}-{len(queued)}",
                fleet=_Fleet(daemons, partitions),
            )
        except QueueUnavailable as exc:
            progress.say(f"queue: {exc}")
            return {"available": False, "reason": str(exc)}
        queued.append({**stats.summary(), **cpu})
        in_process.append(systems.offline(BATCHD, workload))
    result = _compare(
        queued, [stats.summary() for stats in in_process], requests=len(workload.requests)
    )
    return {**result, "daemons": daemons, "partitions": partitions}


def _another_round(done: int, elapsed_s: float, rounds: int | None) -> bool:
    if rounds is not None:
        return done < rounds
    return done < MIN_ROUNDS or (elapsed_s < ROUNDS_BUDGET_S and done < MAX_ROUNDS)


def _compare(
    queued: list[dict[str, Any]], in_process: list[dict[str, Any]], *, requests: int
) -> dict[str, Any]:
    """Per-round ratios and their median; the round nearest the median stands for the run."""
    refs = [(a["tok_s"] + b["tok_s"]) / 2 for a, b in itertools.pairwise(in_process)]
    ratios = [q["tok_s"] / ref if ref > 0 else 0.0 for q, ref in zip(queued, refs, strict=True)]
    median = statistics.median(ratios)
    pick = min(range(len(ratios)), key=lambda i: abs(ratios[i] - median))
    before, after = in_process[pick], in_process[pick + 1]
    fastest = max(r["tok_s"] for r in in_process)
    return {
        "available": True,
        "requests": requests,
        "method": METHOD,
        "queue": queued[pick],
        "in_process": before,
        "in_process_after": after,
        "reference_tok_s": round(refs[pick], 2),
        "ratio": round(median, 3),
        "best_of_ratio": round(max(q["tok_s"] for q in queued) / fastest, 3) if fastest else 0.0,
        "rounds": [
            {
                "in_process_before_tok_s": in_process[i]["tok_s"],
                "queue_tok_s": queued[i]["tok_s"],
                "in_process_after_tok_s": in_process[i + 1]["tok_s"],
                "ratio": round(ratio, 3),
                "subscriber_cpu_s": queued[i]["subscriber_cpu_s"],
                "redis_cpu_s": queued[i]["redis_cpu_s"],
                "redis_servers": queued[i].get("redis_servers"),
                "submit_jobs_s": queued[i].get("submit_jobs_s"),
                "daemon_publish_s": queued[i].get("daemon_publish_s"),
                "daemon_step_s": queued[i].get("daemon_step_s"),
            }
            for i, ratio in enumerate(ratios)
        ],
        "ttft_p50_added_s": round(
            queued[pick]["ttft_p50_s"] - (before["ttft_p50_s"] + after["ttft_p50_s"]) / 2, 4
        ),
    }


def _env_value(value: object) -> str:
    """An option as the settings read it from the environment: a table (the adapters) as
    JSON, anything else as its text."""
    return json.dumps(value) if isinstance(value, dict) else str(value)


@dataclasses.dataclass(frozen=True)
class _Fleet:
    """How many daemons serve the queue, and its partitions."""

    daemons: int = 1
    partitions: int = 1


def _daemon_env(
    systems: Systems,
    workload: Workload,
    redis_url: str,
    prefix: str,
    metrics_port: int,
    partitions: int = 1,
) -> dict[str, str]:
    """Environment of the daemon: the same engine settings as the in-process run."""
    s = systems.settings
    # Sized exactly as the in-process engine's pool (systems.Systems._step_system).
    longest = longest_request(workload, systems.warmup_for(workload))
    config = bench_engine_config(
        s.engine,
        longest_request=longest,
        max_prefill_tokens_with_decodes=s.engine.max_prefill_tokens_with_decodes,
    )
    # Every engine option, so both engines match field by field.
    engine_env = {
        f"BATCHD_ENGINE__{name.upper()}": _env_value(value)
        for name, value in dataclasses.asdict(config).items()
        if value is not None
    }
    return {
        **os.environ,
        "BATCHD_REDIS_URL": redis_url,
        "BATCHD_KEY_PREFIX": prefix,
        "BATCHD_LOG_LEVEL": "WARNING",
        "BATCHD_RESULT_TTL_S": "3600",
        "BATCHD_DAEMON__METRICS_PORT": str(metrics_port),
        "BATCHD_QUEUE__PARTITIONS": str(partitions),
        **engine_env,
    }


def _run_through_daemon(
    systems: Systems,
    workload: Workload,
    redis_url: str,
    progress: Progress,
    *,
    prefix: str,
    fleet: _Fleet,
) -> tuple[RunStats, dict[str, Any]]:
    """The workload through fresh daemons; its stats, the submit rate, the client's and
    Redis's CPU seconds (and each server's, with its commands), and the daemons' seconds
    publishing and stepping."""
    ports = [free_port() for _ in range(fleet.daemons)]
    command = [sys.executable, "-m", "batchd.daemon.cli", "serve"]
    command += ["--model", str(systems.settings.model_path), "--queue", _QUEUE]
    conn = redis_client(redis_url)
    with (
        tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        # On exit, last to first: the daemons stop, the round's keys go, the connection.
        stack.callback(conn.close)
        stack.callback(_delete_prefix, conn, prefix, progress)
        progress.phase("queue / batchd serve: starting the daemons")
        daemons = []
        for i, port in enumerate(ports):
            env = _daemon_env(systems, workload, redis_url, prefix, port, fleet.partitions)
            log_path = Path(tmp) / f"daemon{i}.log"
            with log_path.open("wb") as log:
                daemon = subprocess.Popen(
                    [*command, "--consumer-name", f"bench-{i}"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            stack.callback(_stop, daemon)
            daemons.append((daemon, log_path))
        with _failures_end_the_run():
            _wait_ready(conn, prefix, daemons)
            client = Client(redis_url, prefix=prefix, queue=_QUEUE)
            warm = systems.warmup_for(workload)
            progress.phase(f"{workload.name} / batchd through Redis (warm-up)")
            _submit_and_follow(client, warm, Recorder(total=len(warm.requests)))
            progress.phase(f"{workload.name} / batchd through Redis")
            recorder = Recorder(total=len(workload.requests), on_finish=progress.update)
            # The submitting and following client and Redis share the machine with the
            # daemons; the client runs as the daemons' clients do (bench.subscriber).
            cpu, server, servers = time.process_time(), _redis_cpu_s(conn), _redis_servers(conn)
            daemons_before = [_daemon_times(port) for port in ports]
            submit: dict[str, float] = {}
            stats, nice = run_as_subscriber(
                lambda: _submit_and_follow(client, workload, recorder, submit)
            )
            cpu, server = time.process_time() - cpu, _spent(server, _redis_cpu_s(conn))
            by_server = _servers_spent(servers, _redis_servers(conn))
            daemon_times = _fleet_times(
                [
                    _times_between(before, _daemon_times(port))
                    for before, port in zip(daemons_before, ports, strict=True)
                ]
            )
            client.close()
    figures = {
        "subscriber_cpu_s": round(cpu, 3),
        "subscriber_nice": nice,
        "redis_cpu_s": server,
        "redis_servers": by_server,
        "submit_jobs_s": round(len(workload.requests) / submit["s"], 1)
        if submit.get("s")
        else None,
    }
    return stats, {**figures, **daemon_times}


@contextlib.contextmanager
def _failures_end_the_run() -> Iterator[None]:
    """Redis gone or refusing mid-run, or a job failing: QueueUnavailable, so the queue
    is reported as not available and the other workloads' figures still count."""
    try:
        yield
    except (redis.RedisError, BatchdError) as exc:
        raise QueueUnavailable(
            f"not available: the run through Redis failed: {type(exc).__name__}: {exc}"
        ) from exc


def _redis_cpu_s(conn: redis.Redis) -> float | None:
    """CPU seconds the Redis server (a cluster's primaries) has used since it started; None
    where INFO is refused (NOPERM, a renamed command) or its reply is lost: the figure
    is then left out of the report, and the run it describes stands."""
    servers = _redis_servers(conn)
    return None if servers is None else sum(s["cpu_s"] for s in servers.values())


def _redis_servers(conn: redis.Redis) -> dict[str, dict[str, float]] | None:
    """Each server's CPU seconds and commands processed since it started, by node (a
    cluster's primaries; a single server is ``server``): whether a cluster splits the work
    or repeats it on every primary shows only node by node. None as for _redis_cpu_s."""
    try:
        nodes: Any = (
            conn.info(target_nodes="primaries") if is_cluster(conn) else {"server": conn.info()}
        )
        return {
            node: {
                "cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                "commands": float(info["total_commands_processed"]),
            }
            for node, info in nodes.items()
        }
    except (redis.RedisError, KeyError, ValueError):
        return None


def _servers_spent(
    before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    """Each server's CPU seconds and commands between two readings; None where a reading
    is missing, a node is in one reading only (a failover) or its counters went back."""
    if before is None or after is None or before.keys() != after.keys():
        return None
    spent = {
        node: {key: after[node][key] - before[node][key] for key in ("cpu_s", "commands")}
        for node in before
    }
    if any(value < 0 for figures in spent.values() for value in figures.values()):
        return None
    return {
        node: {"cpu_s": round(figures["cpu_s"], 4), "commands": figures["commands"]}
        for node, figures in spent.items()
    }


# The daemon's series read around a run: its engine thread's seconds on publishes and on
# engine steps, and the count of publishes.
_DAEMON_SERIES = {
    "batchd_publish_duration_seconds_sum": "daemon_publish_s",
    "batchd_publish_duration_seconds_count": "daemon_publishes",
    "batchd_step_duration_seconds_sum": "daemon_step_s",
}


def _daemon_times(port: int) -> dict[str, float] | None:
    """The daemon's publish and step totals from its metrics endpoint; None where it
    does not answer (the figures are then left out of the report)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    return {
        _DAEMON_SERIES[sample.name]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in _DAEMON_SERIES
    }


def _times_between(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None]:
    """What the daemon spent during the run (None each where a reading is missing)."""
    return {
        key: None
        if before is None or after is None or key not in before or key not in after
        else round(after[key] - before[key], 4)
        for key in _DAEMON_SERIES.values()
    }


def _fleet_times(each: list[dict[str, float | None]]) -> dict[str, float | None]:
    """The daemons' figures summed (None where any daemon's is missing)."""
    return {
        key: None
        if any(times[key] is None for times in each)
        else round(sum(times[key] or 0.0 for times in each), 4)
        for key in _DAEMON_SERIES.values()
    }


def _spent(before: float | None, after: float | None) -> float | None:
    """CPU seconds between two readings; None if either is missing or the counters went
    back (Redis restarted in between and started counting again)."""
    if before is None or after is None or after < before:
        return None
    return round(after - before, 3)


def _wait_ready(
    conn: redis.Redis, prefix: str, daemons: list[tuple[subprocess.Popen[bytes], Path]]
) -> None:
    """Until every daemon's heartbeat key appears (each has loaded the model and joined)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        for daemon, log in daemons:
            if daemon.poll() is not None:
                tail = log.read_text(errors="replace")[-600:]
                raise QueueUnavailable(
                    f"not available: batchd serve exited with code {daemon.returncode}: {tail}"
                )
        if len(list(conn.scan_iter(match=Keys(prefix).daemon_pattern, count=100))) >= len(daemons):
            return
        time.sleep(0.2)
    raise QueueUnavailable(f"not available: batchd serve not ready after {_START_TIMEOUT_S:.0f}s")


def _submit_and_follow(
    client: Client, workload: Workload, recorder: Recorder, submit: dict[str, float] | None = None
) -> RunStats:
    """Submit every request at once (one submit_many call: the daemon reads them together,
    as the in-process engine gets them), then follow all their event streams to the end.
    ``submit["s"]``: the seconds the submit took."""
    follower = client.follower(timeout=1800)
    for request in workload.requests:
        recorder.arrive(request.request_id)
        follower.add(request.request_id)
    started = time.perf_counter()
    client.submit_many(
        {
            "prompt_token_ids": request.prompt_ids,
            "id": request.request_id,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
        }
        for request in workload.requests
    )
    if submit is not None:
        submit["s"] = time.perf_counter() - started
    for job_id, event in follow(client.redis, follower):
        if event.error is not None:
            raise QueueUnavailable(f"not available: job {job_id} failed: {event.error}")
        recorder.token(job_id, count=event.token_id is not None, finished=event.final)
    return recorder.result()


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    if daemon.poll() is not None:
        return
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def _delete_prefix(conn: redis.Redis, prefix: str, progress: Progress) -> None:
    """Best effort: a Redis that is gone or refuses keeps the round's keys, and says so
    rather than hiding the run's own outcome."""
    try:
        keys = list(conn.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            conn.delete(*keys[start : start + 500])
    except redis.RedisError as exc:
        progress.say(f"queue: could not delete the keys {prefix}:* ({exc}); delete them by hand")
