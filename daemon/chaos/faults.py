"""The seeded fault schedule and the thread that injects it.

Faults fire at seeded points of the run's progress (a share of the jobs ended),
so they land while jobs run whatever the machine's speed. They run one after the
other; each is held long enough to cross the timeout it targets.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum

from batchd.daemon.chaos.background import Background
from batchd.daemon.chaos.cluster import Cluster
from batchd.daemon.chaos.ledger import Ledger
from batchd.daemon.redis_server import free_port

log = logging.getLogger(__name__)


class FaultKind(str, Enum):
    daemon_kill = "daemon SIGKILL + restart"
    daemon_stop = "daemon SIGSTOP > heartbeat TTL"
    redis_crash = "Redis SIGKILL, last second lost"
    redis_pause = "Redis paused > client timeouts"
    refused_writes = "Redis refuses writes (maxmemory)"
    read_only = "Redis read-only (demoted replica)"
    network_partition = "daemon partitioned > heartbeat TTL"
    failover = "Sentinel failover (master SIGKILL)"
    primary_kill = "Cluster primary SIGKILL, replica promoted"
    migration = "Cluster slot migration of a queue partition"


# On a Sentinel deployment: what each fault needs that it lacks. A partition proxies one
# address (the daemons must follow the master); a paused or demoted master would make the
# Sentinels fail over by themselves, which the failover fault does on purpose.
NOT_ON_SENTINEL = {
    FaultKind.network_partition: "daemons reach Redis without a proxy",
    FaultKind.redis_pause: "a paused master is failed over: see failovers",
    FaultKind.read_only: "a demoted master is reconfigured by the Sentinels",
}
# On a Redis Cluster, the same, and: a node's crash is a primary kill (its replica takes
# over, see primary kills), not a restart of the one server with the last second cut.
NOT_ON_CLUSTER = {
    FaultKind.network_partition: "daemons reach every node without a proxy",
    FaultKind.redis_pause: "a paused primary is failed over: see primary kills",
    FaultKind.read_only: "a demoted primary is replaced by its replica: see primary kills",
    FaultKind.redis_crash: "a crashed node's replica takes over: see primary kills",
}
# Writes a killed master acknowledged this long before its kill may not have reached the
# replica (replication is asynchronous): they are checked and resent where lost.
REPLICATION_LAG_S = 1.0


@dataclass(frozen=True)
class Fault:
    at_progress: float  # share of jobs ended when it fires
    kind: FaultKind
    daemon: int


@dataclass(frozen=True)
class Holds:
    """How long each held fault lasts, from the timeouts it must cross."""

    past_heartbeat_s: float
    past_socket_timeout_s: float
    window_s: float


def schedule(counts: dict[FaultKind, int], daemons: int, seed: int) -> list[Fault]:
    rng = random.Random(seed ^ 0xFA17)
    faults = [
        Fault(rng.uniform(0.03, 0.85), kind, rng.randrange(daemons))
        for kind, count in counts.items()
        for _ in range(count)
    ]
    return sorted(faults, key=lambda f: f.at_progress)


@dataclass(eq=False)
class Injector(Background):
    """Runs the schedule against a cluster, waiting for each fault's point of progress."""

    cluster: Cluster
    ledger: Ledger
    faults: list[Fault]
    holds: Holds
    _: KW_ONLY
    progress: Callable[[], float]
    after_redis_crash: Callable[[float], None]
    fired: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        super().__init__("chaos-faults", join_timeout_s=120)

    def next_point(self) -> float | None:
        """The share of progress at which the next fault fires; None once all have."""
        return self.faults[self.fired].at_progress if self.fired < len(self.faults) else None

    def work(self) -> None:
        for fault in self.faults:
            while self.progress() < fault.at_progress:
                if self.stop.wait(0.1):
                    return
            self.inject(fault)
            self.fired += 1

    def inject(self, fault: Fault) -> None:
        holds, cluster = self.holds, self.cluster
        detail = f"daemon {fault.daemon}"
        if fault.kind is FaultKind.daemon_kill:
            cluster.kill_daemon(fault.daemon)
        elif fault.kind is FaultKind.daemon_stop:
            cluster.pause_daemon(fault.daemon, holds.past_heartbeat_s)
            detail += f", {holds.past_heartbeat_s:.1f}s"
        elif fault.kind is FaultKind.network_partition:
            proxy = cluster.slots[fault.daemon].proxy
            assert proxy is not None, "no partition on Sentinel (NOT_ON_SENTINEL)"
            proxy.pause()
            time.sleep(holds.past_heartbeat_s)
            proxy.resume()
            detail += f", {holds.past_heartbeat_s:.1f}s"
        elif fault.kind is FaultKind.redis_crash:
            cut = cluster.crash_redis()
            self.ledger.cuts.append(cut.since)
            detail = f"{cut.dropped_bytes} bytes of AOF dropped"
            self.after_redis_crash(cut.since)
        elif fault.kind is FaultKind.failover:
            since = time.monotonic() - REPLICATION_LAG_S
            self.ledger.cuts.append(since)  # before the kill: its losses are excused from it
            old, new = cluster.failover()
            detail = f"master :{old} -> :{new}"
            self.after_redis_crash(since)
        elif fault.kind is FaultKind.primary_kill:
            since = time.monotonic() - REPLICATION_LAG_S
            self.ledger.cuts.append(since)
            detail = cluster.kill_primary(fault.daemon)
            self.after_redis_crash(since)
        elif fault.kind is FaultKind.migration:
            detail = cluster.migrate_partition(fault.daemon)
        elif fault.kind is FaultKind.redis_pause:
            cluster.pause_redis(holds.past_socket_timeout_s)
            detail = f"{holds.past_socket_timeout_s:.1f}s"
        elif fault.kind is FaultKind.refused_writes:
            self._window(("maxmemory", "1"), ("maxmemory", "0"))
            detail = f"{holds.window_s:.1f}s"
        else:
            self._read_only()
            detail = f"{holds.window_s:.1f}s"
        self.ledger.fault(fault.kind.name, detail)

    def _window(self, on: tuple[str, str], off: tuple[str, str]) -> None:
        admin = self.cluster.admin()
        try:
            admin.config_set(*on)
            time.sleep(self.holds.window_s)
        finally:
            admin.config_set(*off)
            admin.close()

    def _read_only(self) -> None:
        """A demotion to replica of a master that cannot be reached (a failover gone
        wrong): every write is refused with READONLY until it is promoted again."""
        admin = self.cluster.admin()
        try:
            admin.replicaof("127.0.0.1", free_port())
            time.sleep(self.holds.window_s)
        finally:
            admin.replicaof("NO", "ONE")
            admin.close()
