"""LoRA's cost: the same greedy batch with every row on the base model, every row on one
adapter, and rows of the base model and of several adapters mixed, in alternating rounds
of one process.

From the tests folder:

    cd tests && python -m measure.lora [--model PATH] [--rounds 3] [--requests 24]

Without --model it builds the ``bench-small`` fixture; the adapters are random, rank 8,
of every projection of every layer, and one of q and v only
(batchd.engine.adapters.adapter_fixture). Each mix runs
``--requests`` prompts of 16-128 tokens to ``--max-tokens`` outputs, ignoring EOS, so
every mix computes the same tokens. The figures are output tokens per second of wall
time and per second of this process's CPU time (steadier on a shared host) of each mix
over the base mix's, best round of each. ``base, MLX products`` is the base mix with
BATCHD_NATIVE_PRODUCTS=0 (MLX's products in every layer, as an adapted gate and up
projection take on a CPU), for scale.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.adapters.adapter_fixture import make_adapter
from batchd.engine.forward.native import PRODUCTS_DISABLE_ENV
from batchd.engine.models.loader import load
from batchd.engine.models.model_fixture import FixtureSpec, make_model
from measure.options import engine_parser

ADAPTERS = ("a0", "a1", "a2", "a3")  # of every projection
QV = ("self_attn.q_proj", "self_attn.v_proj")  # PEFT's default targets for llama
# mix name -> the adapter of request i (None: the base model)
MIXES = {
    "base": lambda i: None,
    "one adapter": lambda i: ADAPTERS[0],
    "one adapter of q and v": lambda i: "qv",
    "base + 1 adapter": lambda i: (None, ADAPTERS[0])[i % 2],
    "base + 4 adapters": lambda i: (None, *ADAPTERS)[i % 5],
}


def run_mix(
    eng: LLMEngine, mix: str, *, requests: int, max_tokens: int, tag: str
) -> tuple[int, float, float]:
    """Output tokens, wall seconds and this process's CPU seconds of one mix."""
    rng = random.Random("lora-bench")
    vocab = eng.spec.vocab_size
    for i in range(requests):
        eng.add_request(
            f"{tag}-{i}",
            prompt_token_ids=[rng.randrange(16, vocab) for _ in range(rng.randint(16, 128))],
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            adapter=MIXES[mix](i),
        )
    tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        tokens += len(eng.step())
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    p = engine_parser("lora", __doc__, requests=24, max_tokens=48)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or make_model(root / "bench-small", FixtureSpec(preset="bench-small"))
        base_model = load(model).model
        adapters = {
            name: str(make_adapter(root / name, base_model, seed=i))
            for i, name in enumerate(ADAPTERS)
        }
        adapters["qv"] = str(make_adapter(root / "qv", base_model, seed=9, keys=QV))
        config = EngineConfig(max_num_seqs=args.max_num_seqs, adapters=adapters)
        engines = {"": LLMEngine.from_pretrained(model, config)}
        os.environ[PRODUCTS_DISABLE_ENV] = "0"  # read when a runner is built
        try:
            engines["MLX products"] = LLMEngine.from_pretrained(model, config)
        finally:
            del os.environ[PRODUCTS_DISABLE_ENV]
        runs = [(mix, "") for mix in MIXES] + [("base", "MLX products")]
        for eng in engines.values():
            run_mix(eng, "base + 4 adapters", requests=5, max_tokens=4, tag="warmup")
        best: dict[str, float] = {}
        best_cpu: dict[str, float] = {}
        for r in range(args.rounds):
            for mix, path in runs:
                label = f"{mix}, {path}" if path else mix
                tokens, seconds, cpu = run_mix(
                    engines[path],
                    mix,
                    requests=args.requests,
                    max_tokens=args.max_tokens,
                    tag=f"r{r}",
                )
                rate, per_cpu = tokens / seconds, tokens / cpu
                print(
                    f"round {r} {label}: {tokens} tokens, {rate:.1f} tok/s, {per_cpu:.1f} tok/CPU-s"
                )
                best[label] = max(best.get(label, 0.0), rate)
                best_cpu[label] = max(best_cpu.get(label, 0.0), per_cpu)
    for label, rate in best.items():
        print(
            f"{label}: {rate:.1f} tok/s, {rate / best['base']:.2f}x base; "
            f"{best_cpu[label]:.1f} tok/CPU-s, {best_cpu[label] / best_cpu['base']:.2f}x base"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
