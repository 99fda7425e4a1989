"""A Sentinel deployment on this machine: a master, its replicas and three Sentinels,
each a real ``redis-server`` on a free port in its own folder.

``batchd chaos --deployment sentinel`` runs on one (its failover fault is
:meth:`SentinelDeployment.kill_master` then :meth:`SentinelDeployment.rejoin`), and the
tests start one per test. Failure detection is shortened (``down_after_ms``,
``failover_timeout_ms``) so that a killed master is replaced within a few seconds.
:attr:`SentinelDeployment.url` is the ``redis+sentinel://`` URL every batchd process
connects with. With ``credentials``, the servers get an ACL user of their own and the
Sentinels a password of theirs (the default user of the servers stays open, for the
checks).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from batchd.daemon.redis_server import RedisServer, free_port

SERVICE = "mymaster"
QUORUM = 2
# Replicas sync at once (Redis waits 5 s by default for more replicas to share a transfer).
SYNC_AT_ONCE = ["--repl-diskless-sync-delay", "0"]


@dataclass(frozen=True)
class Credentials:
    """The servers' ACL user and password, and the Sentinels' own password."""

    user: str = "batchd"
    password: str = "master-pw"
    sentinel_password: str = "sentinel-pw"

    def user_args(self) -> list[str]:
        """redis-server options adding the user (all commands, keys and channels)."""
        return ["--user", self.user, "on", f">{self.password}", "~*", "&*", "+@all"]


class SentinelProcess:
    """One ``redis-server --sentinel`` watching ``master_port`` on 127.0.0.1."""

    def __init__(
        self,
        directory: Path,
        master_port: int,
        *,
        down_after_ms: int,
        failover_timeout_ms: int,
        password: str | None = None,
    ) -> None:
        self.directory = directory
        self.password = password
        self.port = free_port()
        # A Sentinel's password is asked of clients and of the other Sentinels alike.
        auth = [f"requirepass {password}", f"sentinel sentinel-pass {password}"] if password else []
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "sentinel.conf"  # Sentinel rewrites it as it learns
        self.config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {directory}",
                    f"logfile {directory / 'sentinel.log'}",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {QUORUM}",
                    f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    *auth,
                ]
            )
            + "\n"
        )
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not on PATH: install Redis")
        self.proc = subprocess.Popen(
            [binary, str(self.config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1
        )

    def master_state(self) -> dict[str, Any] | None:
        """What this Sentinel says of the master now (None while it cannot answer)."""
        with self.client() as client:
            try:
                masters: Any = client.sentinel_masters()
            except redis.RedisError:
                return None
        state: dict[str, Any] | None = masters.get(SERVICE)
        return state

    def log_tail(self) -> str:
        try:
            return (self.directory / "sentinel.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class SentinelDeployment:
    """A master, ``replicas`` replicas of it, three Sentinels; see :func:`sentinel_deployment`."""

    def __init__(
        self,
        directory: Path,
        *,
        replicas: int = 1,
        down_after_ms: int = 1000,  # under ~1 s, a loaded host fails over a live master
        failover_timeout_ms: int = 3000,
        credentials: Credentials | None = None,
    ) -> None:
        self.directory = directory
        self.credentials = credentials
        server_args = [*SYNC_AT_ONCE, *(credentials.user_args() if credentials else [])]
        self.master = RedisServer(directory / "master", extra_args=server_args).start()
        self.replicas: list[RedisServer] = []
        self.sentinels: list[SentinelProcess] = []
        try:  # on a failure, stop what already runs
            for i in range(replicas):
                replica = RedisServer(
                    directory / f"replica{i}",
                    extra_args=[*server_args, "--replicaof", "127.0.0.1", str(self.master.port)],
                )
                self.replicas.append(replica.start())
            for i in range(3):
                self.sentinels.append(
                    SentinelProcess(
                        directory / f"sentinel{i}",
                        self.master.port,
                        down_after_ms=down_after_ms,
                        failover_timeout_ms=failover_timeout_ms,
                        password=credentials.sentinel_password if credentials else None,
                    )
                )
        except BaseException:
            self.stop()
            raise

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master, *self.replicas]

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL of the deployment's master, database 0 (with the
        credentials, when it has them)."""
        hosts = ",".join(s.address for s in self.sentinels)
        if self.credentials is None:
            return f"redis+sentinel://{hosts}/{SERVICE}/0"
        c = self.credentials
        return (
            f"redis+sentinel://{c.user}:{c.password}@{hosts}/{SERVICE}/0"
            f"?sentinel_password={c.sentinel_password}"
        )

    def master_port(self) -> int | None:
        """The master's port as a majority of Sentinels report it (None while they differ)."""
        ports = [s.master_state() for s in self.sentinels]
        seen = [int(p["port"]) for p in ports if p and p.get("is_master")]
        best = max(set(seen), key=seen.count, default=None)
        return best if best is not None and seen.count(best) >= QUORUM else None

    def wait_ready(self, timeout: float = 30) -> None:
        """Until every replica is in sync and every Sentinel knows the replicas and the
        two other Sentinels (so that a failover can be agreed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._synced() and all(self._sees_all(s) for s in self.sentinels):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Sentinel deployment not ready in {timeout}s:\n{self.log_tails()}")

    def _synced(self) -> bool:
        for replica in self.replicas:
            with replica.client() as client:
                info: Any = client.info("replication")
            if info.get("master_link_status") != "up":
                return False
        return True

    def _sees_all(self, sentinel: SentinelProcess) -> bool:
        state = sentinel.master_state()
        return (
            state is not None
            and int(state.get("num-slaves", 0)) >= len(self.replicas)
            and int(state.get("num-other-sentinels", 0)) >= len(self.sentinels) - 1
        )

    def kill_master(self, *, timeout: float = 30) -> RedisServer:
        """SIGKILL the master and wait until the Sentinels agree on a promoted replica that
        takes writes; that replica becomes :attr:`master`, the killed one is returned."""
        old = self.master
        old.kill()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.master_port()
            promoted = next((r for r in self.replicas if r.port == port), None)
            if promoted is not None and _is_master(promoted):
                self.replicas.remove(promoted)
                self.master = promoted
                return old
            time.sleep(0.05)
        raise RuntimeError(f"no replica promoted in {timeout}s:\n{self.log_tails()}")

    def rejoin(self, old: RedisServer, *, timeout: float = 30) -> None:
        """Start a killed master again, on its port, as a replica of the current master,
        and wait until it is in sync and every Sentinel counts it: the next failover has a
        replica to promote."""
        replica_of = ["--replicaof", "127.0.0.1", str(self.master.port)]
        old.extra_args = [*_without_replicaof(old.extra_args), *replica_of]
        old.start()
        self.replicas.append(old)
        self.wait_ready(timeout)

    def log_tails(self) -> str:
        return "\n".join(f"-- {s.directory.name}:\n{s.log_tail()}" for s in self.sentinels)

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.kill()
        for server in self.servers:
            server.kill()


def _without_replicaof(args: list[str]) -> list[str]:
    """``args`` less a ``--replicaof HOST PORT`` (a replica's former master)."""
    if "--replicaof" not in args:
        return args
    at = args.index("--replicaof")
    return args[:at] + args[at + 3 :]


def _is_master(server: RedisServer) -> bool:
    with server.client() as client:
        try:
            info: Any = client.info("replication")
        except redis.RedisError:
            return False
    return bool(info.get("role") == "master")


@contextmanager
def sentinel_deployment(directory: Path, **options: Any) -> Iterator[SentinelDeployment]:
    """A ready deployment (see :class:`SentinelDeployment` for ``options``), stopped on exit."""
    deployment = SentinelDeployment(directory, **options)
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        deployment.stop()
