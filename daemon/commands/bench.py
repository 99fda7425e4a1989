"""``batchd bench``: batchd's engine and its peers on the same model and requests.

Runs the selected workloads against mlx-lm's BatchGenerator, mlx-lm
sequential generation and static batching in one process, writes
report.json / report.md / report.png, and prints the headline ratios as the
last line. Progress goes to stderr. ``--workload gateway`` measures one gateway
process under load instead (batchd.daemon.bench.gateway): report.json / report.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.engine.cache import model_cache
from batchd.engine.config import EngineConfig
from batchd.engine.models.registry import PRESET_NAMES
from batchd.producers.commands.subcommand import add_command, add_model_option


def register(sub: Any) -> None:
    p = add_command(sub, "bench", run)
    p.add_argument(
        "--workload",
        default="all",
        choices=[
            "mixed",
            "shared-prefix",
            "online",
            "queue",
            "all",
            "online-sweep",
            "speculative",
            "backends",
            "gateway",
        ],
        help="which workload to run (default: all: the first four; online-sweep runs the "
        "online arrivals at several prefill bounds, see --sweep-bounds; gateway measures one "
        "batchd gateway process under load, in front of a daemon on --model (default: tiny) "
        "and a private redis-server, see the --gateway-* options; speculative runs batchd "
        "with speculative decoding off and on (see --speculative-method), on an extraction "
        "workload of real text (meaningful with --model smollm2) and on mixed; backends runs "
        "batchd on mixed with each forward backend and sampler, the MLX path sampling on the host "
        "(before) and on the device (after) among them, in alternating rounds)",
    )
    p.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default="ngram",
        help="speculative: the method compared with speculation off: ngram (n-gram prompt "
        "lookup) or draft (a draft model, see --draft-model) (default: ngram)",
    )
    p.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="speculative: the draft model of --speculative-method draft, a model directory, "
        "hub id or preset name sharing --model's tokenizer (required with draft)",
    )
    add_model_option(
        p,
        help="a preset (random-weight shapes, bench-moe a mixture of experts, bench-llama8b "
        "Llama-3-8B's shape in bfloat16 for a GPU; smollm2, "
        "gemma3-270m: the real SmolLM2-135M and Gemma 3 270M), built into "
        f"{model_cache()}/NAME if absent, a model directory (mlx-lm format) or a .gguf file; "
        "--preset is the same option (default: bench-small)",
    )
    p.add_argument("--out", default="bench-out", metavar="DIR", help="report folder")
    p.add_argument(
        "--quick", action="store_true", help="smaller workloads (a few minutes on 2 CPU cores)"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="batchd's running-sequence cap, and BatchGenerator's completion_batch_size "
        "(default: engine.max_num_seqs from settings)",
    )
    p.add_argument(
        "--online-max-prefill-tokens",
        type=_prefill_bound,
        default=argparse.SUPPRESS,
        metavar="N|none",
        help="batchd's engine.max_prefill_tokens_with_decodes in the online workload, a latency "
        "setting (default: 4; none: no bound); the throughput workloads take the engine "
        "settings' value",
    )
    p.add_argument(
        "--sweep-bounds",
        type=_bounds,
        default=None,
        metavar="N,N,...",
        help="online-sweep: batchd's prefill bounds to run, none for no bound "
        "(default: 16,32,64,none)",
    )
    p.add_argument(
        "--sweep-rounds",
        type=_positive,
        default=None,
        metavar="N",
        help="online-sweep: rounds of every setting, in reverse order every other round "
        "(default: 2)",
    )
    p.add_argument(
        "--queue-rounds",
        type=_positive,
        default=None,
        metavar="N",
        help="queue: alternating rounds (a queue run between two in-process runs) behind the "
        "median ratio (default: at least 3, more while the rounds have taken under 240 s, "
        "at most 11)",
    )
    p.add_argument(
        "--queue-requests",
        type=_positive,
        default=None,
        metavar="N",
        help="queue: requests of the queue workload (default: the scale's 32, or 16 with "
        "--quick); more keep more sequences of each daemon running",
    )
    p.add_argument(
        "--queue-daemons",
        type=_positive,
        default=1,
        metavar="N",
        help="queue: daemons serving the queue together (default: 1), on a queue of "
        "[queue] partitions partitions",
    )
    p.add_argument(
        "--gateway-requests",
        type=_positive,
        default=1000,
        metavar="N",
        help="gateway: requests of each rate scenario, 16 and 256 in flight (default: 1000)",
    )
    p.add_argument(
        "--gateway-burst",
        type=_positive,
        default=300,
        metavar="N",
        help="gateway: requests sent at once (default: 300)",
    )
    p.add_argument(
        "--gateway-streams",
        type=_positive,
        default=1000,
        metavar="N",
        help="gateway: SSE streams open at once, each checked for every token (default: 1000)",
    )
    p.add_argument(
        "--gateway-outage-s",
        type=_positive_seconds,
        default=1.0,
        metavar="S",
        help="gateway: seconds Redis is down in the restart scenario (default: 1)",
    )
    p.add_argument(
        "--gateway-after-s",
        type=_positive_seconds,
        default=8.0,
        metavar="S",
        help="gateway: seconds the steady load goes on after Redis is back (default: 8)",
    )
    p.add_argument(
        "--peak-tflops",
        type=_positive_tflops,
        default=None,
        metavar="X",
        help="mixed, shared-prefix: the device's peak TFLOP/s, for each system's MFU of peak "
        "(model FLOPs per second over X; default: on a GPU, its dense bfloat16 peak from "
        "NVIDIA's datasheets, e.g. 989.5 for an H100 or H200 SXM; on the CPU none, and "
        "no MFU of peak)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    # Test knob: a scale smaller than --quick (tests/test_bench_smoke.py).
    p.add_argument("--scale", choices=["full", "quick", "tiny"], help=argparse.SUPPRESS)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_tflops(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of TFLOP/s, got {text!r}")
    return value


def _prefill_bound(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or none, got {text!r}"
        ) from None


def _bounds(text: str) -> tuple[int | None, ...]:
    return tuple(_prefill_bound(part.strip()) for part in text.split(","))


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The model directory and its label; builds or converts a preset if missing."""
    from batchd.engine.models.registry import ensure_preset, resolve_model

    name = args.model or "bench-small"
    if name in PRESET_NAMES:
        target = model_cache() / name
        if not (target / "config.json").is_file():
            print(f"[bench] building the {name} model in {target} ...", file=sys.stderr)
        return ensure_preset(name), name
    path = Path(resolve_model(name))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {name}: no config.json in that folder")
    return path, path.name


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Benchmark batchd against mlx-lm's BatchGenerator, sequential and static batching.

    Run batchd's engine and its peers on the same model and seeded requests, side by side, and
    report throughput ratios, latency and model-FLOPs utilisation.
    """
    problem = speculative_problem(args)
    if problem:
        print(f"batchd bench: {problem}", file=sys.stderr)
        return 2
    if args.workload == "gateway":
        return bench_gateway(args)
    # Without the daemon or bench extra these raise ModuleNotFoundError, which the
    # dispatcher (batchd.daemon.cli) turns into the install command.
    from batchd.daemon.bench.progress import Progress
    from batchd.daemon.bench.report import write_report
    from batchd.daemon.bench.runner import (
        ONLINE_MAX_PREFILL_TOKENS,
        WORKLOADS,
        BenchOptions,
        run_bench,
    )
    from batchd.daemon.bench.sweep import DEFAULT_BOUNDS, DEFAULT_ROUNDS
    from batchd.daemon.bench.workloads import SCALES

    try:
        model_path, label = resolve_model(args)
    except (OSError, ValueError) as exc:
        print(f"batchd bench: {exc}", file=sys.stderr)
        return 2
    scale = args.scale or ("quick" if args.quick else "full")
    engine = bench_engine(args, settings)
    max_num_seqs = engine.max_num_seqs
    # Absent unless given (argparse.SUPPRESS), so that "none" can mean no bound.
    online_bound = getattr(args, "online_max_prefill_tokens", ONLINE_MAX_PREFILL_TOKENS)
    options = BenchOptions(
        model_path=model_path,
        model_label=label,
        workloads=WORKLOADS if args.workload == "all" else (args.workload,),
        scale=SCALES[scale],
        engine=engine,
        redis_url=settings.redis_url,
        seed=args.seed,
        online_max_prefill_tokens_with_decodes=online_bound,
        sweep_bounds=args.sweep_bounds or DEFAULT_BOUNDS,
        sweep_rounds=args.sweep_rounds or DEFAULT_ROUNDS,
        queue_rounds=args.queue_rounds,
        queue_daemons=args.queue_daemons,
        queue_requests=args.queue_requests,
        queue_partitions=settings.queue.partitions,
        speculative_method=args.speculative_method,
        speculative_draft_model=args.draft_model,
        peak_tflops=args.peak_tflops,
        command=(
            f"batchd bench --workload {args.workload} "
            + f"--model {args.model or label}"
            + (" --quick" if scale == "quick" else "")
            + f" --max-num-seqs {max_num_seqs} --seed {args.seed}"
            + f" --online-max-prefill-tokens {online_bound if online_bound else 'none'}"
            + _sweep_options(args)
            + (f" --queue-rounds {args.queue_rounds}" if args.queue_rounds else "")
            + (f" --queue-daemons {args.queue_daemons}" if args.queue_daemons > 1 else "")
            + (f" --queue-requests {args.queue_requests}" if args.queue_requests else "")
            + _speculative_options(args)
            + (f" --peak-tflops {args.peak_tflops:g}" if args.peak_tflops else "")
        ),
    )
    report = run_bench(options, Progress())
    paths = write_report(report, Path(args.out))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    print(report["headline"])
    return 0


def speculative_problem(args: argparse.Namespace) -> str | None:
    """Why --speculative-method and --draft-model do not go together, or None."""
    if args.speculative_method == "draft" and not args.draft_model:
        return (
            "--speculative-method draft needs --draft-model MODEL (a model directory, "
            "hub id or preset name with --model's tokenizer)"
        )
    if args.draft_model and args.speculative_method != "draft":
        return "--draft-model is used only with --speculative-method draft"
    return None


def _speculative_options(args: argparse.Namespace) -> str:
    """The speculative workload's method as given, for the report's command line."""
    if args.workload != "speculative":
        return ""
    draft = f" --draft-model {args.draft_model}" if args.draft_model else ""
    return f" --speculative-method {args.speculative_method}{draft}"


def bench_gateway(args: argparse.Namespace) -> int:
    """The gateway workload: its own redis-server, daemon and gateway (not --redis-url)."""
    # Not the model workloads' modules: those load mlx-lm, which lowers the open-files
    # limit this process needs (a socket per request).
    from batchd.daemon.bench.gateway.load import GatewayOptions, run_gateway
    from batchd.daemon.bench.gateway.report import write_gateway_report
    from batchd.daemon.bench.progress import Progress

    model = args.model or "tiny"
    options = GatewayOptions(
        requests=args.gateway_requests,
        burst=args.gateway_burst,
        streams=args.gateway_streams,
        outage_s=args.gateway_outage_s,
        after_s=args.gateway_after_s,
        model=model,
        command=(
            f"batchd bench --workload gateway --model {model}"
            f" --gateway-requests {args.gateway_requests} --gateway-burst {args.gateway_burst}"
            f" --gateway-streams {args.gateway_streams}"
            f" --gateway-outage-s {args.gateway_outage_s:g}"
            f" --gateway-after-s {args.gateway_after_s:g}"
        ),
    )
    try:
        report = run_gateway(options, Progress())
    except RuntimeError as exc:  # a process of the stack failed, or no redis-server
        print(f"batchd bench: gateway: {exc}", file=sys.stderr)
        return 1
    paths = write_gateway_report(report, Path(args.out))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    print(report["headline"])
    return 0


def bench_engine(args: argparse.Namespace, settings: Settings) -> EngineConfig:
    """batchd's engine options for the run: the settings' engine section, every field
    (TOML, BATCHD_ENGINE__* variables), with ``--max-num-seqs`` on top (and a step budget
    that lets that many decode)."""
    engine = settings.engine
    if not args.max_num_seqs:
        return engine
    budget = max(engine.max_num_batched_tokens, args.max_num_seqs)
    return dataclasses.replace(
        engine, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget
    )


def _sweep_options(args: argparse.Namespace) -> str:
    """The sweep's options as given, for the report's command line."""
    if args.workload != "online-sweep":
        return ""
    bounds = args.sweep_bounds
    shown = "" if bounds is None else ",".join("none" if b is None else str(b) for b in bounds)
    return (f" --sweep-bounds {shown}" if shown else "") + (
        f" --sweep-rounds {args.sweep_rounds}" if args.sweep_rounds else ""
    )
