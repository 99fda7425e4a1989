"""One chaos run: reference, cluster, load and faults together, then the verdict.

The reference runs first, in-process and alone, so it is the fault-free run of
the very requests the cluster then serves under faults.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchd.config.settings import Settings
from batchd.daemon.chaos.background import Background
from batchd.daemon.chaos.cluster import Cluster
from batchd.daemon.chaos.faults import (
    NOT_ON_CLUSTER,
    NOT_ON_SENTINEL,
    FaultKind,
    Holds,
    Injector,
    schedule,
)
from batchd.daemon.chaos.ledger import Ledger
from batchd.daemon.chaos.options import ChaosOptions
from batchd.daemon.chaos.producer import Producer
from batchd.daemon.chaos.reference import reference_outputs
from batchd.daemon.chaos.subscribers import Subscriber
from batchd.daemon.chaos.verdict import Verdict, judge
from batchd.daemon.chaos.workload import make_jobs
from batchd.engine import EngineConfig
from batchd.producers.connection.factory import is_cluster
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)

# A Redis Cluster run's queue partitions: one per primary.
CLUSTER_PARTITIONS = 3


@dataclass
class ChaosResult:
    options: ChaosOptions
    verdict: Verdict
    ledger: Ledger
    seconds: float
    reference_seconds: float
    peak_redis_bytes: int
    keys_left: int
    other_keys: list[str] = field(default_factory=list)
    # Each per-job key counted in ``keys_left``: its name, type, TTL and what it holds.
    left: list[str] = field(default_factory=list)
    # Per-job keys still there once the result TTL passed but gone within the TTL they
    # had then (it started late), as described then.
    late: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the run itself broke
    # After the result TTLs: status hashes still queued or running (a job no daemon will
    # end), and per-job keys with no TTL at all (they would stay forever).
    stuck_running: int = 0
    keys_without_ttl: int = 0

    @property
    def passed(self) -> bool:
        return (
            self.verdict.passed
            and self.keys_left == 0
            and self.stuck_running == 0
            and self.keys_without_ttl == 0
            and not self.failures
        )


def chaos_settings(options: ChaosOptions, engine: EngineConfig) -> Settings:
    """The daemons' settings: production code, with timeouts short enough that each held
    fault crosses them within seconds; on a Redis Cluster, a partitioned queue."""
    return Settings(
        result_ttl_s=options.result_ttl_s,
        engine=engine,
        queue={"partitions": run_keys(options).partitions},
        daemon={
            "heartbeat_interval_s": 0.5,
            "heartbeat_ttl_s": 2.0,
            "claim_interval_s": 0.5,
            "block_ms": 200,
            "grace_period_s": 5.0,
            "redis_retry_max_s": 0.5,
        },
    )


def run_keys(options: ChaosOptions) -> Keys:
    """The key layout the run's daemons claim: partitioned on a Redis Cluster."""
    if options.deployment == "cluster":
        return Keys(partitions=CLUSTER_PARTITIONS, tagged=True)
    return Keys()


def fault_counts(options: ChaosOptions) -> dict[FaultKind, int]:
    """How many of each fault. On Sentinel a Redis crash is a crash of the current master,
    that is a failover, and the faults that need one address are not run; on a Redis
    Cluster neither are those it cannot take (:data:`NOT_ON_CLUSTER`)."""
    sentinel, cluster = options.deployment == "sentinel", options.deployment == "cluster"
    counts = {
        FaultKind.daemon_kill: options.kills,
        FaultKind.redis_crash: 0 if sentinel or cluster else options.redis_crashes,
        FaultKind.failover: options.failovers + options.redis_crashes if sentinel else 0,
        FaultKind.primary_kill: options.primary_kills,
        FaultKind.migration: options.migrations,
    }
    for kind in FaultKind:
        skipped = (sentinel and kind in NOT_ON_SENTINEL) or (cluster and kind in NOT_ON_CLUSTER)
        counts.setdefault(kind, 0 if skipped else options.each_other_fault)
    return counts


def _deployment_said(options: ChaosOptions, progress: Callable[[str], None]) -> None:
    """What the run starts, and the faults it skips there (with why)."""
    described = {
        "single": "redis-server (AOF everysec)",
        "sentinel": "a master, a replica, 3 Sentinels",
        "cluster": f"a Redis Cluster (3 primaries + 3 replicas), {CLUSTER_PARTITIONS} partitions",
    }
    progress(f"starting {described[options.deployment]} and {options.daemons} daemons")
    if options.deployment == "sentinel" and options.each_other_fault:
        progress("not run on Sentinel: " + "; ".join(NOT_ON_SENTINEL.values()))
    if options.deployment == "cluster" and (options.each_other_fault or options.redis_crashes):
        reasons = (f"{kind.value}: {why}" for kind, why in NOT_ON_CLUSTER.items())
        progress("not run on Redis Cluster: " + "; ".join(reasons))


def run_chaos(
    options: ChaosOptions,
    *,
    model: Path,
    engine: EngineConfig,
    workdir: Path,
    progress: Callable[[str], None] = lambda line: None,
) -> ChaosResult:
    jobs = make_jobs(options.jobs, options.seed, vocab=_vocab(model))
    progress(f"reference: {len(jobs)} jobs in-process, no faults")
    reference, reference_seconds = reference_outputs(model, engine, jobs)
    settings = chaos_settings(options, engine)
    keys = run_keys(options)
    cluster = Cluster(workdir, model, options.daemons, settings, options.deployment, keys)
    _deployment_said(options, progress)
    cluster.start()
    ledger = Ledger()
    holds = Holds(
        past_heartbeat_s=settings.daemon.heartbeat_ttl_s + 1.5,
        past_socket_timeout_s=settings.daemon.block_ms / 1000 + 5.0 + 1.5,
        window_s=2.0,
    )
    faults = schedule(fault_counts(options), options.daemons, options.seed)
    failures: list[str] = []
    started = time.monotonic()
    deadline = started + options.minutes * 60
    injector: Injector | None = None

    def may_submit(index: int) -> bool:
        """A fault fires when its share of jobs is submitted; the producer runs at most a
        window ahead of the next one, so every fault meets jobs in flight."""
        point = injector.next_point() if injector is not None else None
        return point is None or index < point * len(jobs) + options.window

    subscribers: list[Subscriber] = []
    producer = Producer(
        cluster.url,
        ledger,
        jobs,
        keys=keys,
        hostile=options.hostile,
        seed=options.seed,
        window=options.window,
        follow=lambda job_id: subscribers[zlib.crc32(job_id.encode()) % len(subscribers)].inbox.put(
            job_id
        ),
        may_submit=may_submit,
        result_ttl_s=options.result_ttl_s,
    )
    by_id = {job.id: job for job in jobs}
    subscribers += [
        Subscriber(
            i, cluster.url, ledger, producer, by_id, keys, seed=options.seed, resume_every=40
        )
        for i in range(options.subscribers)
    ]
    injector = Injector(
        cluster,
        ledger,
        faults,
        holds,
        progress=lambda: len(ledger.submitted) / len(jobs),
        after_redis_crash=producer.after_redis_crash,
    )
    peak = _MemoryWatch(cluster)
    parts: list[tuple[str, Injector | Producer | Subscriber]] = [
        ("fault injector", injector),
        ("producer", producer),
        *((f"subscriber {s.index}", s) for s in subscribers),
    ]

    def stop_load() -> None:
        for _, part in parts:
            part.join()
        peak.join()

    try:
        for subscriber in subscribers:
            subscriber.start()
        injector.start()
        producer.start()
        peak.start()
        _wait(
            ledger,
            jobs_total=len(jobs),
            injector=injector,
            deadline=deadline,
            broken=lambda: any(part.error is not None for _, part in parts),
            progress=progress,
        )
        if time.monotonic() >= deadline:
            failures.append(f"not done within --minutes {options.minutes}")
        stop_load()
        seconds = time.monotonic() - started
        failures += [f"{name} failed: {part.error!r}" for name, part in parts if part.error]
        failures += _unasked_failovers(cluster, ledger)
        admin = cluster.admin()
        verdict = judge(
            jobs, reference, ledger, admin, keys, unexpected_exits=len(cluster.unexpected_exits)
        )
        verdict.findings += cluster.unexpected_exits
        progress(f"waiting {options.result_ttl_s}s for the results to expire")
        time.sleep(options.result_ttl_s + 2)
        left, late, other_keys = _keys_left(admin, keys)
        stuck_running, keys_without_ttl = _left_forever(admin, keys, verdict)
        admin.close()
    finally:
        stop_load()
        cluster.stop()
    return ChaosResult(
        options,
        verdict,
        ledger,
        seconds,
        reference_seconds,
        peak.bytes,
        len(left),
        other_keys,
        left,
        late,
        failures,
        stuck_running,
        keys_without_ttl,
    )


def _unasked_failovers(cluster: Cluster, ledger: Ledger) -> list[str]:
    """A failover nobody asked for, as a failure: the writes it lost would go unchecked."""
    if cluster.kind == "sentinel":
        switches, asked = cluster.master_switches(), ledger.faults["failover"]
        return [] if switches == asked else [f"{switches} master switches, {asked} asked"]
    if cluster.kind == "cluster":
        switches, asked = cluster.primary_switches(), ledger.faults["primary_kill"]
        return [] if switches == asked else [f"{switches} replica promotions, {asked} asked"]
    return []


def _wait(
    ledger: Ledger,
    *,
    jobs_total: int,
    injector: Injector,
    deadline: float,
    broken: Callable[[], bool],
    progress: Callable[[str], None],
) -> None:
    """Until every job ended and every fault fired, a part of the run broke (reported as
    a failure, not waited on), or the deadline."""
    last_report = 0.0
    while time.monotonic() < deadline and not broken():
        ended = len(ledger.finished_at)
        if ended >= jobs_total and injector.next_point() is None:
            return
        if time.monotonic() - last_report >= 5:
            last_report = time.monotonic()
            progress(
                f"{ended}/{jobs_total} jobs ended, {sum(ledger.faults.values())} faults, "
                f"{len(ledger.hostile)} hostile sent"
            )
        time.sleep(0.1)


class _MemoryWatch(Background):
    """Samples Redis's used memory; the peak goes in the table."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__("chaos-memory", join_timeout_s=5)
        self.cluster = cluster
        self.bytes = 0

    def work(self) -> None:
        admin = self.cluster.admin()
        while not self.stop.wait(0.25):
            try:
                used = _used_memory(admin)
            except redis.RedisError:  # down, paused or failed over: ask the master again
                admin.close()
                admin = self.cluster.admin()
                continue
            self.bytes = max(self.bytes, used)
        admin.close()


def _used_memory(admin: redis.Redis) -> int:
    """Redis's used memory: on a Redis Cluster, its primaries' together."""
    if is_cluster(admin):
        nodes: Any = admin.info("memory", target_nodes="primaries")
        return sum(int(info["used_memory"]) for info in nodes.values())
    info: Any = admin.info("memory")
    return int(info["used_memory"])


def _job_prefixes(keys: Keys) -> list[str]:
    """What every per-job key starts with, one per partition (a partition's head is what
    its dead-letter stream's name starts with)."""
    return [keys.dead_stream(k).removesuffix("dead") + "job:" for k in range(keys.partitions)]


def _job_keys(client: redis.Redis, keys: Keys) -> list[bytes]:
    # The chaos run's prefix holds no glob character: a head is its own pattern.
    return [key for p in _job_prefixes(keys) for key in client.scan_iter(f"{p}*")]


def _keys_left(client: redis.Redis, keys: Keys) -> tuple[list[str], list[str], list[str]]:
    """Per-job keys still in Redis once the result TTLs passed, each described
    (:func:`_described`): those still there after the longest TTL they had then ran
    out too (must be none), and those gone by then; and the names of the other keys.

    A TTL starts when the job's entry is acked, which can come well after the end its
    subscriber read: a daemon killed or paused between storing an end and acking it
    leaves the ack to the daemon that claims the entry once its heartbeat expired, or
    to itself when it runs again (seconds; more when every daemon is down at once).
    Such keys go within the TTL they have; a key that stays past it had its TTL
    started again after the run, or has none."""
    first = _left_now(client, keys)
    running = [int(client.pttl(key)) for key in first]
    if max(running, default=0) > 0:
        time.sleep(max(running) / 1000 + 1)
    stayed = _left_now(client, keys)
    late = [line for key, line in first.items() if key not in stayed]
    prefixes = tuple(p.encode() for p in _job_prefixes(keys))
    others = sorted(k.decode() for k in client.scan_iter("*") if not k.startswith(prefixes))
    return list(stayed.values()), late, others


def _left_now(client: redis.Redis, keys: Keys) -> dict[bytes, str]:
    """Every per-job key Redis holds now, described."""
    described = {key: _described(client, key) for key in _job_keys(client, keys)}
    return {key: line for key, line in described.items() if line is not None}


def _described(client: redis.Redis, key: bytes) -> str | None:
    """A key left over as ``name (type, TTL s): contents``: whether it lost its TTL or
    got one late, and which write last made it, can then be read off a failed run. None
    when it expired since the scan found it."""
    raw: Any = client.type(key)
    kind = raw.decode()
    held: Any
    if kind == "none":
        return None
    if kind == "hash":
        fields: Any = client.hgetall(key)
        held = {
            k.decode(errors="replace"): v.decode(errors="replace")[:80] for k, v in fields.items()
        }
    elif kind == "stream":
        last: Any = client.xrevrange(key, count=1)
        held = f"{client.xlen(key)} entries, last {last[0][0].decode() if last else None}: "
        held += str(last[0][1])[:160] if last else ""
    else:
        held = "?"
    return f"{key.decode(errors='replace')} ({kind}, TTL {client.ttl(key)} s): {held}"


def _left_forever(client: redis.Redis, keys: Keys, verdict: Verdict) -> tuple[int, int]:
    """Jobs whose status still says queued or running once every result expired, and
    per-job keys without a TTL; each is named in the findings."""
    stuck = no_ttl = 0
    for key in _job_keys(client, keys):
        name = key.decode(errors="replace")
        if client.ttl(key) == -1:
            no_ttl += 1
            verdict.findings.append(f"{name}: no TTL")
        if client.type(key) == b"hash" and client.hget(key, "state") in (b"queued", b"running"):
            stuck += 1
            verdict.findings.append(f"{name}: still {client.hget(key, 'state')!r}")
    return stuck, no_ttl


def _vocab(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    vocab: int = config["vocab_size"]
    return vocab
