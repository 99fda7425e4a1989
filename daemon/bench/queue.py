"""The queue workload: the mixed requests through Redis against the engine in-process.

Producers submit every job onto a stream, a ``batchd serve`` daemon (a
separate process, as in production) runs them on its engine and publishes
every token, and one subscriber follows all the jobs' event streams. The same
engine settings driven in-process, minutes apart, give the reference; the
ratio (output tok/s through the queue over in-process) is the queue layer's
cost. All keys live under a private prefix, deleted afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from daemon.bench.engine_system import bench_engine_config
from daemon.bench.progress import Progress
from daemon.bench.stats import Recorder, RunStats
from daemon.bench.systems import BATCHD, Systems, SystemUnavailable
from daemon.bench.workloads import Workload
from producers.client import Client, follow

_SERVE_MODULE = "daemon.serve_cmd"
_QUEUE = "bench"
_START_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 30.0


class QueueUnavailable(RuntimeError):
    """The queue run could not happen; the message says why (for the report)."""


def daemon_unavailable(redis_url: str) -> str | None:
    """Why the queue workload cannot run here, or None when it can."""
    if importlib.util.find_spec(_SERVE_MODULE) is None:
        return "not available: daemon missing"
    try:
        with redis.Redis.from_url(redis_url, socket_connect_timeout=2) as conn:
            conn.ping()
    except redis.RedisError as exc:
        return f"not available: no Redis at {redis_url} ({exc})"
    return None


def run_queue(
    systems: Systems, workload: Workload, *, redis_url: str, progress: Progress
) -> dict[str, Any]:
    """In-process, through Redis, in-process again; queue tok/s over the in-process mean.

    Bracketing the queue run with two in-process runs cancels most of the
    drift of a shared machine's load over those minutes.
    """
    reason = daemon_unavailable(redis_url)
    if reason is None:
        try:
            before = systems.offline(BATCHD, workload)
        except SystemUnavailable as exc:
            reason = f"not available: {exc}"
    if reason is not None:
        progress.say(f"queue: {reason}")
        return {"available": False, "reason": reason}
    try:
        through_queue, subscriber_cpu = _run_through_daemon(systems, workload, redis_url, progress)
    except QueueUnavailable as exc:
        progress.say(f"queue: {exc}")
        return {"available": False, "reason": str(exc)}
    ours = through_queue.summary()
    ours["subscriber_cpu_s"] = round(subscriber_cpu, 3)
    first, second = before.summary(), systems.offline(BATCHD, workload).summary()
    reference = (first["tok_s"] + second["tok_s"]) / 2
    return {
        "available": True,
        "requests": len(workload.requests),
        "queue": ours,
        "in_process": first,
        "in_process_after": second,
        "reference_tok_s": round(reference, 2),
        "ratio": round(ours["tok_s"] / reference, 3) if reference > 0 else 0.0,
        "ttft_p50_added_s": round(
            ours["ttft_p50_s"] - (first["ttft_p50_s"] + second["ttft_p50_s"]) / 2, 4
        ),
    }


def _daemon_env(
    systems: Systems, workload: Workload, redis_url: str, prefix: str
) -> dict[str, str]:
    """Environment of the daemon: the same engine settings as the in-process run."""
    s = systems.settings
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
    config = bench_engine_config(
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        longest_request=longest,
    )
    return {
        **os.environ,
        "BATCHD_REDIS_URL": redis_url,
        "BATCHD_KEY_PREFIX": prefix,
        "BATCHD_LOG_LEVEL": "WARNING",
        "BATCHD_RESULT_TTL_S": "3600",
        "BATCHD_ENGINE__MAX_NUM_SEQS": str(config.max_num_seqs),
        "BATCHD_ENGINE__MAX_NUM_BATCHED_TOKENS": str(config.max_num_batched_tokens),
        "BATCHD_ENGINE__BLOCK_SIZE": str(config.block_size),
        "BATCHD_ENGINE__NUM_KV_BLOCKS": str(config.num_kv_blocks),
    }


def _run_through_daemon(
    systems: Systems, workload: Workload, redis_url: str, progress: Progress
) -> tuple[RunStats, float]:
    """The workload through a fresh daemon; its stats and the client's CPU seconds."""
    prefix = f"batchd-bench-{os.getpid()}"
    env = _daemon_env(systems, workload, redis_url, prefix)
    command = [sys.executable, "-m", "daemon.cli", "serve"]
    command += ["--model", str(systems.settings.model_path), "--queue", _QUEUE]
    conn = redis.Redis.from_url(redis_url)
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        log_path = Path(tmp) / "daemon.log"
        progress.phase("queue / batchd serve: starting the daemon")
        with log_path.open("wb") as log:
            daemon = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(conn, prefix, daemon, log_path)
            client = Client(redis_url, prefix=prefix, queue=_QUEUE)
            warm = systems.warmup_for(workload)
            progress.phase(f"{workload.name} / batchd through Redis (warm-up)")
            _submit_and_follow(client, warm, Recorder(total=len(warm.requests)))
            progress.phase(f"{workload.name} / batchd through Redis")
            recorder = Recorder(total=len(workload.requests), on_finish=progress.update)
            cpu = time.process_time()
            stats = _submit_and_follow(client, workload, recorder)
            # The submitting and following client shares the machine with the daemon.
            cpu = time.process_time() - cpu
            client.close()
        finally:
            _stop(daemon)
            _delete_prefix(conn, prefix)
            conn.close()
    return stats, cpu


def _wait_ready(conn: redis.Redis, prefix: str, daemon: subprocess.Popen[bytes], log: Path) -> None:
    """Until the daemon's heartbeat key appears (it has loaded the model and joined)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            tail = log.read_text(errors="replace")[-600:]
            raise QueueUnavailable(
                f"not available: batchd serve exited with code {daemon.returncode}: {tail}"
            )
        if any(conn.scan_iter(match=f"{prefix}:daemon:*", count=100)):
            return
        time.sleep(0.2)
    raise QueueUnavailable(f"not available: batchd serve not ready after {_START_TIMEOUT_S:.0f}s")


def _submit_and_follow(client: Client, workload: Workload, recorder: Recorder) -> RunStats:
    """Submit every request at once, then follow all their event streams to the end."""
    follower = client.follower(timeout=1800)
    for request in workload.requests:
        recorder.arrive(request.request_id)
        client.submit(
            prompt_token_ids=request.prompt_ids,
            id=request.request_id,
            max_tokens=request.max_tokens,
            ignore_eos=True,
        )
        follower.add(request.request_id)
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


def _delete_prefix(conn: redis.Redis, prefix: str) -> None:
    keys = list(conn.scan_iter(match=f"{prefix}:*", count=1000))
    for start in range(0, len(keys), 500):
        conn.delete(*keys[start : start + 500])
