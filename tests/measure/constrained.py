"""Structured output's cost: the mixed workload with 0%, 25% and 100% of its requests
constrained to a nested JSON schema, in alternating rounds of one process.

From the tests folder (the schema is the tests'):

    cd tests && python -m measure.constrained [--model PATH] [--rounds 3] [--requests 32]
    cd tests && python -m measure.constrained --mask-time [--model PATH]

Without --model it builds the ``bench-small`` fixture (vocabulary 32,000). Every
request samples (temperature 1, seeded); unconstrained ones ignore EOS and run to
max_tokens, constrained ones end when their JSON is complete. The figure is output
tokens/s of each mix over the unconstrained mix's, best round of each. --mask-time
instead times the grammar alone on the model's tokenizer: compile, then one mask per
step (the engine's call, bits unpacked) along random allowed tokens until the JSON ends.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import GrammarTokenizer
from batchd.engine.models.loader import load
from measure.options import engine_parser
from support.schemas import nested_constraint

FRACTIONS = (0.0, 0.25, 1.0)


def run_mix(
    eng: LLMEngine, fraction: float, *, requests: int, max_tokens: int, tag: str
) -> tuple[int, float]:
    """Run one mix to completion; (output tokens, seconds)."""
    rng = random.Random("constrained-bench")
    constraint = nested_constraint()
    vocab = eng.spec.vocab_size
    for i in range(requests):
        constrained = i < round(fraction * requests)
        eng.add_request(
            f"{tag}-{i}",
            prompt_token_ids=[rng.randrange(16, vocab) for _ in range(rng.randint(16, 128))],
            params=SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                seed=i,
                ignore_eos=not constrained,
                constraint=constraint if constrained else None,
            ),
        )
    tokens, start = 0, time.perf_counter()
    while eng.has_unfinished():
        tokens += len(eng.step())
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = engine_parser("constrained", __doc__, requests=32, max_tokens=64)
    p.add_argument("--mask-time", action="store_true", help="time the grammar masks only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _fixture(Path(tmp))
        if args.mask_time:
            return mask_time(model)
        eng = LLMEngine.from_pretrained(model, EngineConfig(max_num_seqs=args.max_num_seqs))
        run_mix(eng, 1.0, requests=4, max_tokens=8, tag="warmup")
        best: dict[float, float] = {}
        for r in range(args.rounds):
            for fraction in FRACTIONS:
                tokens, seconds = run_mix(
                    eng,
                    fraction,
                    requests=args.requests,
                    max_tokens=args.max_tokens,
                    tag=f"r{r}-{fraction}",
                )
                rate = tokens / seconds
                print(f"round {r} constrained {fraction:>4.0%}: {tokens} tokens, {rate:.1f} tok/s")
                best[fraction] = max(best.get(fraction, 0.0), rate)
    for fraction in FRACTIONS:
        print(
            f"constrained {fraction:>4.0%}: {best[fraction]:.1f} tok/s, "
            f"{best[fraction] / best[0.0]:.2f}x unconstrained"
        )
    return 0


def mask_time(model: Path, walks: int = 20) -> int:
    """Print compile and per-step mask times of NESTED_SCHEMA on ``model``'s tokenizer."""
    loaded = load(model)
    eos = [int(t) for t in loaded.tokenizer.eos_token_ids]
    tokenizer = GrammarTokenizer(loaded.tokenizer, loaded.spec.vocab_size, eos)
    tokenizer.matcher(nested_constraint())  # builds llguidance's tokenizer once
    rng = np.random.default_rng(0)
    compiles, masks = [], []
    for _ in range(walks):
        start = time.perf_counter()
        matcher = tokenizer.matcher(nested_constraint())
        compiles.append(time.perf_counter() - start)
        while not matcher.stopped:
            start = time.perf_counter()
            (allowed,) = tokenizer.masks([matcher])
            masks.append(time.perf_counter() - start)
            matcher.consume(int(rng.choice(np.flatnonzero(allowed))))
    ms = sorted(m * 1e6 for m in masks)
    print(
        f"vocab {loaded.spec.vocab_size}: compile {statistics.median(compiles) * 1e3:.2f} ms; "
        f"mask per step ({len(ms)} steps) median {statistics.median(ms):.0f} us, "
        f"p90 {ms[int(0.9 * len(ms))]:.0f} us, max {ms[-1]:.0f} us"
    )
    return 0


def _fixture(root: Path) -> Path:
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(root / "bench-small", FixtureSpec(preset="bench-small"))


if __name__ == "__main__":
    raise SystemExit(main())
