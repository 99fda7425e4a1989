"""The system under test: one redis-server (AOF, ``everysec``) and D ``batchd serve``
processes, each reaching Redis through its own proxy so one can be partitioned alone.

On a Sentinel deployment (``deployment="sentinel"``) the daemons connect with the
``redis+sentinel://`` URL instead: no proxy (they must follow the master wherever it
moves), and the Redis fault is :meth:`Cluster.failover`. On a Redis Cluster
(``deployment="cluster"``: 3 primaries, a replica each) they connect with the
``redis+cluster://`` URL, and the Redis faults are :meth:`Cluster.kill_primary` and
:meth:`Cluster.migrate_partition`.

Every daemon exit the run did not cause is counted (and the daemon restarted, so one
crash does not hide the rest of the run's findings).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from redis.crc import key_slot

from batchd.config.settings import Settings
from batchd.daemon.chaos.aof import AofTail, Cut
from batchd.daemon.chaos.proxy import Proxy
from batchd.daemon.cluster_server import ClusterDeployment
from batchd.daemon.redis_server import RedisServer
from batchd.daemon.sentinel_server import SentinelDeployment
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)

SERVING = b"serving queues"
# A master silent this long is down for the Sentinels. Shorter ones fail over by
# themselves when the run's own load (every process on a few cores) delays a reply.
SENTINEL_DOWN_AFTER_MS = 2000
# The same for a Redis Cluster's nodes (cluster-node-timeout).
CLUSTER_NODE_TIMEOUT_MS = 2000
# A migrating slot moves this many keys per MIGRATE, this far apart: it stays half moved
# (clients redirected with ASK, scripts over both halves told TRYAGAIN) for seconds.
MIGRATE_BATCH = 4
MIGRATE_PAUSE_S = 0.05


@dataclass
class DaemonSlot:
    """One daemon position: its proxy outlives the processes that fill the slot."""

    index: int
    proxy: Proxy | None  # None on Sentinel and Cluster: the daemon finds the nodes itself
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    # Set by the run before a signal it sends, so the exit it causes is not a finding.
    expecting_exit: bool = False
    starts: int = 0


@dataclass
class Cluster:
    """Start with :meth:`start`; stop with :meth:`stop`."""

    workdir: Path
    model: Path
    daemons: int
    settings: Settings
    kind: str = "single"  # single, sentinel or cluster: batchd.daemon.chaos.options
    # The run's key layout (partitioned on a Redis Cluster), for the Redis faults.
    keys: Keys = field(default_factory=Keys)
    redis_server: RedisServer = field(init=False)
    deployment: SentinelDeployment | None = field(init=False, default=None)
    redis_cluster: ClusterDeployment | None = field(init=False, default=None)
    aof: AofTail = field(init=False)
    slots: list[DaemonSlot] = field(default_factory=list)
    # Each daemon death the run did not cause, as a finding: exit code and last log lines.
    unexpected_exits: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watching: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.redis_server = RedisServer(
            self.workdir / "redis",
            appendonly=True,
            extra_args=["--appendfsync", "everysec", "--aof-load-truncated", "yes"],
        )
        self.aof = AofTail(self.redis_server.directory)

    @property
    def sentinel(self) -> bool:
        return self.kind == "sentinel"

    @property
    def url(self) -> str:
        if self.redis_cluster is not None:
            return self.redis_cluster.url
        return self.deployment.url if self.deployment else self.redis_server.url

    @property
    def master(self) -> RedisServer:
        """The server taking writes now (the deployment's master, on Sentinel)."""
        return self.deployment.master if self.deployment else self.redis_server

    def admin(self) -> redis.Redis:
        """A direct connection (no proxy) to the master, for the fault injector and the
        checks; on a Redis Cluster, a cluster client (typed as the ``redis.Redis`` whose
        commands it shares)."""
        if self.redis_cluster is not None:
            client: Any = self.redis_cluster.client(socket_timeout=5, socket_connect_timeout=5)
            return client
        return redis.Redis.from_url(self.master.url, socket_timeout=5, socket_connect_timeout=5)

    def start(self) -> Cluster:
        if self.kind == "cluster":
            self.redis_cluster = ClusterDeployment(
                self.workdir / "cluster",
                node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS,
                extra_args=["--appendfsync", "everysec"],
            )
            self.redis_cluster.wait_ready()
        elif self.sentinel:
            self.deployment = SentinelDeployment(
                self.workdir / "sentinel", down_after_ms=SENTINEL_DOWN_AFTER_MS
            )
            self.deployment.wait_ready()
        else:
            self.redis_server.start()
            self.aof.start()
        for index in range(self.daemons):
            proxy = Proxy(self.redis_server.port) if self.kind == "single" else None
            slot = DaemonSlot(index, proxy, self.workdir / f"daemon{index}.log")
            self.slots.append(slot)
            self._spawn(slot)
        for slot in self.slots:
            self._wait_serving(slot)
        self._watching.set()
        threading.Thread(target=self._watch, name="chaos-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._watching.clear()
        for slot in self.slots:
            slot.expecting_exit = True
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)
        for slot in self.slots:
            if slot.proc is not None:
                try:
                    slot.proc.wait(30)
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    slot.proc.wait(10)
            if slot.proxy is not None:
                slot.proxy.close()
        if self.redis_cluster is not None:
            self.redis_cluster.stop()
            return
        if self.deployment is not None:
            self.deployment.stop()
            return
        self.aof.join()
        self.redis_server.stop()

    # -- daemons ----------------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
        sections = self.settings.model_dump(
            mode="json", include={"daemon", "engine", "limits", "queue"}
        )
        env.update(
            {f"BATCHD_{name.upper()}": orjson.dumps(v).decode() for name, v in sections.items()}
        )
        env["BATCHD_RESULT_TTL_S"] = str(self.settings.result_ttl_s)
        env["BATCHD_LOG_LEVEL"] = "INFO"
        return env

    def _spawn(self, slot: DaemonSlot) -> None:
        args = [sys.executable, "-m", "batchd.daemon.cli", "serve", "--model", str(self.model)]
        args += ["--redis-url", slot.proxy.url if slot.proxy else self.url]
        with open(slot.log_path, "ab") as out:
            out.write(f"--- start {slot.starts}\n".encode())
            slot.proc = subprocess.Popen(
                args,
                cwd=self.workdir,
                env=self._environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        slot.starts += 1
        slot.expecting_exit = False

    def _wait_serving(self, slot: DaemonSlot, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        marker = f"--- start {slot.starts - 1}\n".encode()
        while time.monotonic() < deadline:
            text = slot.log_path.read_bytes()
            if SERVING in text[text.rfind(marker) :]:
                return
            if slot.proc is not None and slot.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon {slot.index} did not start:\n{self.log_tail(slot)}")

    def log_tail(self, slot: DaemonSlot, size: int = 3000) -> str:
        return slot.log_path.read_bytes()[-size:].decode(errors="replace")

    def kill_daemon(self, index: int) -> None:
        """SIGKILL, then a new process in the slot (as a supervisor would restart it)."""
        slot = self.slots[index]
        with self._lock:
            slot.expecting_exit = True
            assert slot.proc is not None
            slot.proc.kill()
            slot.proc.wait(10)
            self._spawn(slot)

    def pause_daemon(self, index: int, seconds: float) -> None:
        """Frozen for ``seconds`` (a GC pause, a swapped-out host), then on again."""
        _frozen_for(self.slots[index].proc, seconds)

    def _watch(self) -> None:
        while self._watching.is_set():
            time.sleep(0.2)
            for slot in self.slots:
                with self._lock:
                    proc = slot.proc
                    if proc is None or proc.poll() is None or slot.expecting_exit:
                        continue
                    self.unexpected_exits.append(
                        f"daemon {slot.index} exited {proc.returncode}:\n{self.log_tail(slot)}"
                    )
                    log.error("daemon %d exited (%d) unasked", slot.index, proc.returncode)
                    self._spawn(slot)

    # -- redis ------------------------------------------------------------------------------

    def crash_redis(self) -> Cut:
        """SIGKILL Redis, drop its unsynced last second, start it again on the same port."""
        self.redis_server.kill()
        cut = self.aof.cut()
        self.redis_server.start(timeout_s=60)
        return cut

    def failover(self) -> tuple[int, int]:
        """SIGKILL the master; once the Sentinels promoted its replica, start the killed
        one again as a replica of the new master (ready for the next failover). Returns
        the old and the new master's ports."""
        assert self.deployment is not None, "a failover needs the Sentinel deployment"
        deployment = self.deployment
        old = deployment.kill_master()
        deployment.rejoin(old)
        if (named := deployment.master_port()) != deployment.master.port:
            # A failover the run did not ask for: its lost writes would go unchecked.
            raise RuntimeError(
                f"Sentinels name master :{named}, the run promoted :{deployment.master.port}"
                f":\n{deployment.log_tails()}"
            )
        return old.port, deployment.master.port

    def master_switches(self) -> int:
        """Master changes the first Sentinel logged: each failover, asked for or not."""
        assert self.deployment is not None
        sentinel_log = self.deployment.sentinels[0].directory / "sentinel.log"
        return sentinel_log.read_text(errors="replace").count("+switch-master")

    def kill_primary(self, pick: int) -> str:
        """SIGKILL the primary of queue partition ``pick`` (modulo the partitions); once its
        replica is promoted, start the killed node again as a replica of it (ready for the
        next kill). Returns what happened, for the fault log."""
        deployment = self._redis_cluster()
        slot = self._partition_slot(pick)
        old = deployment.kill_primary(slot=slot)
        new = deployment.owner(slot)
        deployment.rejoin(old)
        return f"slot {slot}: primary :{old.port} -> :{new.port}"

    def migrate_partition(self, pick: int) -> str:
        """Move the slot of queue partition ``pick`` (modulo the partitions) live to the next
        primary; returns what moved, for the fault log."""
        deployment = self._redis_cluster()
        slot = self._partition_slot(pick)
        source = deployment.owner(slot)
        primaries = sorted(deployment.primaries(), key=lambda node: node.port)
        target = primaries[(primaries.index(source) + 1) % len(primaries)]
        moved = deployment.migrate_slots(
            [slot], target, batch=MIGRATE_BATCH, pause_s=MIGRATE_PAUSE_S
        )
        return f"slot {slot}: {moved} keys :{source.port} -> :{target.port}"

    def primary_switches(self) -> int:
        """Replica promotions the nodes logged: each primary kill's, asked for or not."""
        deployment = self._redis_cluster()
        return sum(
            node.log_path.read_text(errors="replace").count("Failover election won")
            for node in deployment.nodes
        )

    def _redis_cluster(self) -> ClusterDeployment:
        assert self.redis_cluster is not None, "a Redis Cluster fault needs the cluster"
        return self.redis_cluster

    def _partition_slot(self, pick: int) -> int:
        return key_slot(self.keys.queue(partition=pick % self.keys.partitions).encode())

    def pause_redis(self, seconds: float) -> None:
        _frozen_for(self.redis_server.proc, seconds)


def _frozen_for(proc: subprocess.Popen[bytes] | None, seconds: float) -> None:
    """SIGSTOP, ``seconds``, SIGCONT: the process holds its sockets and answers nothing."""
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)
