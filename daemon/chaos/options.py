"""What a chaos run does: its size, its seed and how many of each fault (light to import:
the command line reads the defaults from here without loading MLX)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChaosOptions:
    jobs: int = 2000
    kills: int = 20
    daemons: int = 2
    seed: int = 0
    minutes: float = 30.0
    hostile: int = 200
    redis_crashes: int = 2
    # How many of each other fault: daemon stop, partition, Redis pause, refused writes,
    # read-only window.
    each_other_fault: int = 1
    subscribers: int = 4
    window: int = 48
    result_ttl_s: int = 60
