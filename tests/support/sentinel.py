"""The tests' Sentinel deployment: the product's own (batchd.daemon.sentinel_server)."""

from batchd.daemon.sentinel_server import (
    QUORUM,
    SERVICE,
    SYNC_AT_ONCE,
    Credentials,
    SentinelDeployment,
    SentinelProcess,
    sentinel_deployment,
)

__all__ = [
    "QUORUM",
    "SERVICE",
    "SYNC_AT_ONCE",
    "Credentials",
    "SentinelDeployment",
    "SentinelProcess",
    "sentinel_deployment",
]
