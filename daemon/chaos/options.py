"""What a chaos run does: its size, its seed and how many of each fault (light to import:
the command line builds its options from these fields without loading MLX)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

DEPLOYMENTS = ("single", "sentinel", "cluster")


def flag(default: int | float | str, about: str, **argparse_options: Any) -> Any:
    """A field that is also a ``batchd chaos`` option; ``about`` is its help text."""
    return field(default=default, metadata={"help": about, **argparse_options})


@dataclass(frozen=True)
class ChaosOptions:
    jobs: int = flag(2000, "jobs to run")
    kills: int = flag(20, "daemon SIGKILLs")
    daemons: int = flag(2, "daemons")
    seed: int = flag(0, "seed of jobs and faults")
    minutes: float = flag(30.0, "give up after this many minutes")
    hostile: int = flag(200, "hostile entries")
    redis_crashes: int = flag(2, "Redis SIGKILLs losing the last second of writes")
    each_other_fault: int = flag(
        1,
        "how many of each other fault: daemon SIGSTOP, partition, Redis pause, refused "
        "writes, read-only window (on sentinel and cluster: daemon SIGSTOP and refused "
        "writes only)",
        metavar="N",
    )
    deployment: str = flag(
        "single",
        "the Redis the run starts: one redis-server; a master, a replica and three "
        "Sentinels (a Redis SIGKILL is then a kill of the current master); or a Redis "
        "Cluster of 3 primaries with a replica each, the queue in 3 partitions",
        choices=DEPLOYMENTS,
    )
    failovers: int = flag(
        0,
        "Sentinel failovers: SIGKILL the current master (needs --deployment sentinel)",
        metavar="N",
    )
    primary_kills: int = flag(
        0,
        "Redis Cluster primary kills: SIGKILL a primary, its replica promoted, the old one "
        "back as a replica (needs --deployment cluster)",
        metavar="N",
    )
    migrations: int = flag(
        0,
        "Redis Cluster slot migrations: a queue partition's slot moved live to another "
        "primary (needs --deployment cluster)",
        metavar="N",
    )
    subscribers: int = 4
    window: int = 48
    result_ttl_s: int = flag(
        60,
        "result_ttl_s of the run's daemons; the keys left are counted after it",
        metavar="S",
        name="--result-ttl",
    )


def problem(options: ChaosOptions) -> str | None:
    """Why ``batchd chaos`` refuses these options (None: it runs them)."""
    if min(options.jobs, options.daemons) < 1:
        return "--jobs and --daemons must be >= 1"
    counts = (options.kills, options.hostile, options.redis_crashes, options.each_other_fault)
    if min(*counts, options.failovers, options.primary_kills, options.migrations) < 0:
        return "fault counts must be >= 0"
    if options.failovers and options.deployment != "sentinel":
        return "--failovers needs --deployment sentinel (one redis-server has no replica)"
    if (options.primary_kills or options.migrations) and options.deployment != "cluster":
        return "--primary-kills and --migrations need --deployment cluster"
    return None


def command_line_fields() -> list[Field[Any]]:
    """The fields ``batchd chaos`` takes as options (those declared with :func:`flag`)."""
    return [f for f in fields(ChaosOptions) if "help" in f.metadata]


def from_command_line(args: Any) -> ChaosOptions:
    """The options parsed by ``batchd chaos`` (an argparse namespace), defaults for the rest."""
    return ChaosOptions(**{f.name: getattr(args, f.name) for f in command_line_fields()})


def option_name(f: Field[Any]) -> str:
    return str(f.metadata.get("name", "--" + f.name.replace("_", "-")))
