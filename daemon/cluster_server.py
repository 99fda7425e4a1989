"""A Redis Cluster on this machine: primaries and their replicas, each a real
``redis-server`` on free ports in its own folder.

Status: works (create, primary kill + promotion, rejoin, live slot migration);
tests/ha/test_cluster_server.py checks it, fixture ``redis_cluster`` in tests/ha/conftest.py.

The tests start one per test, and ``batchd chaos --deployment cluster`` runs on one (its
faults are :meth:`ClusterDeployment.kill_primary` then :meth:`ClusterDeployment.rejoin`,
and :meth:`ClusterDeployment.migrate_slots`). It is made the way an operator makes one:
``redis-cli --cluster create ... --cluster-replicas R``. Failure detection is shortened
(``node_timeout_ms``) so that a killed primary is replaced within seconds; shorter still,
a loaded host fails over a live primary. Every node keeps an AOF (``appendfsync
always``, unless ``extra_args`` say otherwise), so a restarted node has its data back.
:attr:`ClusterDeployment.url` is the ``redis+cluster://`` URL every batchd process
connects with.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from batchd.daemon.redis_server import RedisServer

# Replicas sync at once (Redis waits 5 s by default for more replicas to share a transfer).
SYNC_AT_ONCE = ["--repl-diskless-sync-delay", "0"]
# Keys moved by one MIGRATE while a slot migrates (redis-cli's default pipeline).
MIGRATE_BATCH = 10
MIGRATE_TIMEOUT_MS = 10_000


def has_cluster_cli() -> bool:
    """Whether a ``redis-cli`` with the ``--cluster`` manager (Redis 5+) is on PATH."""
    binary = shutil.which("redis-cli")
    if binary is None:
        return False
    out = subprocess.run([binary, "--cluster", "help"], capture_output=True, text=True, timeout=10)
    return "create" in out.stdout + out.stderr


class ClusterDeployment:
    """``primaries`` primaries with ``replicas_per_primary`` replicas each; see
    :func:`cluster_deployment`. Nodes keep their port and folder across a kill and a
    :meth:`rejoin`, so :attr:`nodes` lists every node, live or not."""

    def __init__(
        self,
        directory: Path,
        *,
        primaries: int = 3,
        replicas_per_primary: int = 1,
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
    ) -> None:
        if primaries < 3:
            raise ValueError(f"a Redis Cluster needs 3 primaries or more, not {primaries}")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not on PATH: install Redis")
        self.cli = cli
        self.directory = directory
        self.nodes: list[RedisServer] = []
        try:  # on a failure, stop what already runs
            for i in range(primaries * (1 + replicas_per_primary)):
                self.nodes.append(self._node(directory / f"node{i}", node_timeout_ms, extra_args))
            for node in self.nodes:
                node.start()
            self._create(replicas_per_primary)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _node(directory: Path, node_timeout_ms: int, extra_args: Sequence[str]) -> RedisServer:
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",  # in the node's --dir
            "--cluster-node-timeout",
            str(node_timeout_ms),
            # A replica long cut from its primary may still be promoted: the test
            # deployment prefers availability to the freshest data.
            "--cluster-replica-validity-factor",
            "0",
            *SYNC_AT_ONCE,
            *extra_args,
        ]
        return RedisServer(directory, appendonly=True, extra_args=args, cluster_bus=True)

    def _create(self, replicas_per_primary: int) -> None:
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        out = subprocess.run(
            [self.cli, "--cluster", "create", *addresses]
            + ["--cluster-replicas", str(replicas_per_primary), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0 or "[OK] All 16384 slots covered" not in out.stdout:
            raise RuntimeError(
                f"redis-cli --cluster create failed (exit {out.returncode}):\n"
                f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
            )

    # -- what the cluster looks like now

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL naming every node (a client starts from any live one)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def client(self, **options: Any) -> RedisCluster:
        """A redis-py cluster client (``options``: its keywords) starting from every node."""
        startup = [ClusterNode("127.0.0.1", node.port) for node in self.nodes]
        return RedisCluster(startup_nodes=startup, **options)

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.proc is not None]

    def primaries(self) -> list[RedisServer]:
        """The live nodes that are primaries now."""
        return [node for node in self.live() if _info(node, "replication").get("role") == "master"]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The live nodes replicating ``primary``."""
        port = primary.port
        return [
            node
            for node in self.live()
            if _info(node, "replication").get("master_port") == port and node is not primary
        ]

    def node_id(self, node: RedisServer) -> str:
        with node.client() as client:
            return str(client.execute_command("CLUSTER MYID").decode())

    def owner(self, slot: int) -> RedisServer:
        """The primary serving ``slot`` now, as a live node says."""
        port = self._slot_map(self.live()[0]).get(slot)
        found = next((node for node in self.live() if node.port == port), None)
        if found is None:
            raise RuntimeError(f"slot {slot} has no live primary (owner port {port})")
        return found

    def _slot_map(self, node: RedisServer) -> dict[int, int]:
        """slot -> the port of its primary, as ``node`` sees the cluster."""
        with node.client() as client:
            ranges: Any = client.execute_command("CLUSTER SLOTS")
        owners: dict[int, int] = {}
        for start, end, primary, *_ in _raw_slots(ranges):
            for slot in range(start, end + 1):
                owners[slot] = primary
        return owners

    # -- readiness

    def wait_ready(self, timeout: float = 60) -> None:
        """Until every live node says ``cluster_state:ok``, knows every node, agrees on
        every slot's primary (a live one), flags no live node as failing, and every replica
        is in sync with its primary."""
        deadline = time.monotonic() + timeout
        problem = "not checked"
        while time.monotonic() < deadline:
            try:
                problem = self._problem()
            except redis.RedisError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if not problem:
                return
            time.sleep(0.1)
        raise RuntimeError(f"Redis Cluster not ready in {timeout}s: {problem}\n{self.log_tails()}")

    def _problem(self) -> str:
        """Why the cluster is not ready yet ('' when it is)."""
        live = self.live()
        live_ports = {node.port for node in live}
        maps = []
        for node in live:
            info = _cluster_info(node)
            if info.get("cluster_state") != "ok":
                return f"node {node.port}: cluster_state {info.get('cluster_state')}"
            if int(info.get("cluster_known_nodes", 0)) < len(self.nodes):
                return f"node {node.port} knows {info.get('cluster_known_nodes')} nodes"
            if flagged := _failing_ports(node) & live_ports:
                return f"node {node.port} flags live nodes {sorted(flagged)} as failing"
            replication = _info(node, "replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return f"replica {node.port}: link to its primary is down"
            maps.append(self._slot_map(node))
        first = maps[0]
        if len(first) != REDIS_CLUSTER_HASH_SLOTS:
            return f"{len(first)} slots assigned"
        if any(other != first for other in maps[1:]):
            return "the nodes disagree on slot owners"
        if not set(first.values()) <= live_ports:
            return "a slot's primary is not running"
        return ""

    # -- faults

    def kill_primary(self, slot: int | None = None, *, timeout: float = 60) -> RedisServer:
        """SIGKILL the primary serving ``slot`` (by default the first primary) and wait
        until one of its replicas is promoted and every other node says the cluster is ok;
        returns the killed node (for :meth:`rejoin`)."""
        victim = self.owner(slot) if slot is not None else self.primaries()[0]
        if not self.replicas_of(victim):
            raise RuntimeError(f"primary {victim.port} has no replica to promote")
        victim.kill()
        self.wait_ready(timeout)
        return victim

    def rejoin(self, node: RedisServer, *, timeout: float = 60) -> None:
        """Start a killed node again on its port and folder: it rejoins the cluster with
        its ``nodes.conf`` and, its slots now served by the replica promoted in its place,
        turns into that replica's replica. Waits until it is in sync and the cluster is ok."""
        node.start()
        deadline = time.monotonic() + timeout
        while _info(node, "replication").get("role") != "slave":
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node.port} did not turn replica:\n{self.log_tails()}")
            time.sleep(0.1)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def migrate_slots(
        self,
        slots: Iterable[int],
        target: RedisServer,
        *,
        batch: int = MIGRATE_BATCH,
        pause_s: float = 0.0,
    ) -> int:
        """Move ``slots`` to primary ``target`` while clients keep using them, as
        ``redis-cli --cluster reshard`` does: per slot, IMPORTING on the target, MIGRATING
        on the source, MIGRATE its keys in batches (clients meanwhile follow ``ASK`` for
        keys already moved, ``TRYAGAIN`` for a command over keys on both sides), then
        ``SETSLOT NODE`` on the target, the source and every other primary. ``batch`` keys
        go per MIGRATE, ``pause_s`` apart: a pause holds a slot half moved for longer, as
        a slot of many keys is in production. Returns how many keys moved."""
        target_id = self.node_id(target)
        moved = 0
        for slot in slots:
            source = self.owner(slot)
            if source is target:
                continue
            moved += self._migrate_slot(slot, source, target, target_id, batch, pause_s)
        self.wait_ready()
        return moved

    def _migrate_slot(
        self,
        slot: int,
        source: RedisServer,
        target: RedisServer,
        target_id: str,
        batch: int,
        pause_s: float,
    ) -> int:
        source_id = self.node_id(source)
        moved = 0
        with source.client() as src, target.client() as dst:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
                src.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys
                )
                moved += len(keys)
                time.sleep(pause_s)
            dst.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
            src.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        for other in self.primaries():
            if other not in (source, target):
                with other.client() as client:
                    client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        return moved

    def log_tails(self) -> str:
        return "\n".join(f"-- {node.directory.name}:\n{node._log_tail()}" for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def _raw_slots(ranges: Any) -> Iterator[tuple[int, int, int]]:
    """``(start, end, primary port)`` of each range of a CLUSTER SLOTS reply (redis-py
    parses it into a dict keyed by ``(start, end)``; a raw reply is a list)."""
    if isinstance(ranges, dict):
        for (start, end), owners in ranges.items():
            yield int(start), int(end), int(owners["primary"][1])
    else:
        for start, end, primary, *_ in ranges:
            yield int(start), int(end), int(primary[1])


def _info(node: RedisServer, section: str) -> dict[str, Any]:
    with node.client() as client:
        try:
            info: dict[str, Any] = client.info(section)
        except redis.RedisError:
            return {}
    return info


def _cluster_info(node: RedisServer) -> dict[str, str]:
    """CLUSTER INFO of ``node`` (redis-py parses it into a dict)."""
    with node.client() as client:
        info: dict[str, str] = client.execute_command("CLUSTER INFO")
    return info


def _failing_ports(node: RedisServer) -> set[int]:
    """Ports of the nodes ``node`` flags as failing (``fail`` or ``fail?``)."""
    with node.client() as client:
        nodes: dict[str, dict[str, Any]] = client.execute_command("CLUSTER NODES")
    return {
        int(address.rsplit(":", 1)[1])
        for address, state in nodes.items()
        if "fail" in state["flags"] and ":" in address
    }


@contextmanager
def cluster_deployment(directory: Path, **options: Any) -> Iterator[ClusterDeployment]:
    """A ready cluster (see :class:`ClusterDeployment` for ``options``), stopped on exit."""
    deployment = ClusterDeployment(directory, **options)
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        deployment.stop()
