"""Engine-only throughput check: LLMEngine against mlx-lm's BatchGenerator, side by side.

A scaled-down mixed workload (BENCHMARK.md): seeded random prompts, greedy,
ignore EOS, everything arriving at t=0; output tokens per second of each, and
their ratio. The full benchmark is ``batchd bench``; this is the quick loop
for engine work:

    .venv/bin/python -m engine.quick_compare --requests 16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_fixture import PRESETS, FixtureSpec, make_model
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def mixed_workload(
    *,
    requests: int,
    vocab: int,
    seed: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(16, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(requests)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(requests)])


def run_engine(eng: LLMEngine, work: Workload) -> tuple[float, list[list[int]]]:
    """Seconds to finish the workload, and the tokens made."""
    start = time.perf_counter()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    tokens = eng.generate(work.prompts, params)
    return time.perf_counter() - start, tokens


def run_batch_generator(model: Any, work: Workload, *, batch_size: int) -> float:
    """Seconds for mlx-lm's BatchGenerator to finish the workload."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=batch_size)
    start = time.perf_counter()
    gen.insert(work.prompts, max_tokens=work.max_tokens)
    left = len(work.prompts)
    while left:
        _, responses = gen.next()
        left -= sum(r.finish_reason is not None for r in responses)
    elapsed = time.perf_counter() - start
    gen.close()
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-small", choices=sorted(PRESETS))
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a fixture model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="alternating runs of each")
    parser.add_argument("--skip-peer", action="store_true", help="time LLMEngine only")
    args = parser.parse_args(argv)

    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"batchd-{args.preset}"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, FixtureSpec(preset=args.preset))
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.max_num_seqs * (-(-(args.prompt_len[1] + args.output_len[1]) // 16) + 1)
        + 64,
    )
    eng = LLMEngine.from_pretrained(model_dir, config)
    vocab = PRESETS[args.preset]["vocab_size"]
    work = mixed_workload(
        requests=args.requests,
        vocab=vocab,
        seed=args.seed,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
    )
    warm = mixed_workload(
        requests=2, vocab=vocab, seed=args.seed + 1, prompt_len=(8, 32), output_len=(4, 8)
    )
    run_engine(eng, warm)
    tokens = work.output_tokens
    if args.skip_peer:
        batchd_s, _ = run_engine(eng, work)
        print(
            f"batchd LLMEngine: {tokens} tokens in {batchd_s:.2f} s = {tokens / batchd_s:.1f} tok/s"
        )
        return
    run_batch_generator(eng.model, warm, batch_size=args.max_num_seqs)
    # Alternate the two and keep each one's best: the machine is shared and noisy.
    batchd_s = peer_s = float("inf")
    for _ in range(args.repeat):
        batchd_s = min(batchd_s, run_engine(eng, work)[0])
        peer_s = min(peer_s, run_batch_generator(eng.model, work, batch_size=args.max_num_seqs))
    print(
        f"batchd LLMEngine:      {tokens} tokens in {batchd_s:.2f} s "
        f"= {tokens / batchd_s:.1f} tok/s"
    )
    print(f"mlx-lm BatchGenerator: {tokens} tokens in {peer_s:.2f} s = {tokens / peer_s:.1f} tok/s")
    print(f"ratio batchd / BatchGenerator: {peer_s / batchd_s:.2f}x (best of {args.repeat} each)")


if __name__ == "__main__":
    main()
