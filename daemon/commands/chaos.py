"""``batchd chaos``: the reliability proving ground (see daemon.chaos)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from config import Settings
from daemon.chaos.options import ChaosOptions
from engine.models.registry import PRESET_NAMES


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="run jobs through daemons while killing, pausing and partitioning them and Redis; "
        "check every job against a fault-free run",
        description="Starts its own redis-server (AOF, appendfsync everysec) and D daemons, "
        "submits seeded jobs (client and bare XADD, duplicates, cancels, hostile entries) "
        "with subscribers that disconnect and resume, injects faults at seeded moments, "
        "then checks every job against an in-process run of the same requests. Prints one "
        "table; exits 1 if anything was lost, doubled, broken or different.",
    )
    defaults = ChaosOptions()
    p.add_argument("--jobs", type=int, default=defaults.jobs, help="jobs to run (default 2000)")
    p.add_argument("--kills", type=int, default=defaults.kills, help="daemon SIGKILLs (default 20)")
    p.add_argument("--daemons", type=int, default=defaults.daemons, help="daemons (default 2)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of jobs and faults")
    p.add_argument(
        "--minutes", type=float, default=defaults.minutes, help="give up after (default 30)"
    )
    p.add_argument(
        "--hostile", type=int, default=defaults.hostile, help="hostile entries (default 200)"
    )
    p.add_argument(
        "--redis-crashes",
        type=int,
        default=defaults.redis_crashes,
        help="Redis SIGKILLs losing the last second of writes (default 2)",
    )
    p.add_argument(
        "--each-other-fault",
        type=int,
        default=defaults.each_other_fault,
        metavar="N",
        help="how many of each other fault: daemon SIGSTOP, partition, Redis pause, "
        "refused writes, read-only window (default 1)",
    )
    p.add_argument(
        "--result-ttl",
        type=int,
        default=defaults.result_ttl_s,
        metavar="S",
        help="result_ttl_s of the run's daemons; the keys left are counted after it (default 60)",
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=PRESET_NAMES,
        help="model to serve (default tiny: random weights, fast steps)",
    )
    p.add_argument("--workdir", metavar="DIR", help="keep Redis data and daemon logs here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from daemon.chaos.report import render
    from daemon.chaos.run import run_chaos
    from engine.models.registry import ensure_preset

    if min(args.jobs, args.daemons) < 1 or min(args.kills, args.hostile) < 0:
        print("batchd chaos: --jobs, --daemons >= 1 and fault counts >= 0", file=sys.stderr)
        return 2
    options = ChaosOptions(
        jobs=args.jobs,
        kills=args.kills,
        daemons=args.daemons,
        seed=args.seed,
        minutes=args.minutes,
        hostile=args.hostile,
        redis_crashes=args.redis_crashes,
        each_other_fault=args.each_other_fault,
        result_ttl_s=args.result_ttl,
    )
    engine = dataclasses.replace(
        settings.engine, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512
    )
    with tempfile.TemporaryDirectory(prefix="batchd-chaos-") as scratch:
        workdir = Path(args.workdir or scratch)
        model = ensure_preset(args.preset)
        result = run_chaos(
            options,
            model=model,
            engine=engine,
            workdir=workdir,
            progress=lambda line: print(f"chaos: {line}", file=sys.stderr, flush=True),
        )
        print(render(result, command=" ".join(["batchd", *sys.argv[1:]])))
    return 0 if result.passed else 1
