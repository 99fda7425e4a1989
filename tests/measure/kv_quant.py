"""KV-cache quantization's gain and cost: sequences that fit a memory budget, and greedy
agreement and logprob drift of 8-bit and 4-bit KV against float KV on the parity set.

From the tests folder (the parity set is the tests'):

    cd tests && python -m measure.kv_quant [--model tiny|smollm2] [--budget-mib 256]
    cd tests && python -m measure.kv_quant --model smollm2 --chat [--mlx-lm]
    cd tests && python -m measure.kv_quant --model smollm2 --speed 2

The budget table plans the pool of SmolLM2-135M (float32 as served, and float16) at
``--budget-mib`` of KV with each storage, and counts the sequences of 1024 tokens (the
default kv_tokens_per_seq) it holds. The accuracy table runs the parity tests' requests
(tests/engine/test_parity.py's mixed batch for tiny; the four scenarios of
test_parity_smollm2.py for smollm2, converted from its packaged GGUF in float32 as the
tests do) through one engine per storage, greedy with EOS ignored, and compares each
quantized run with the float run, request by request: exact requests, token agreement
(tokens before the first divergence, of all tokens), the first divergence's position,
and |delta logprob| of the chosen tokens while the two agree. ``--chat`` runs 16
everyday questions through the chat template instead (48 greedy tokens each);
``--mlx-lm`` compares mlx-lm's own QuantizedKVCache with its float cache on the same
requests, one at a time, to tell batchd's cost from the method's. ``--speed`` times a
decode-heavy batch with each storage instead (on a CPU, quantized KV leaves the C kernels).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.forward import native
from batchd.engine.forward.kv_pool import plan_pool
from batchd.engine.forward.kv_quant import KVQuant
from batchd.engine.models.loader import LoadedModel, ModelSpec, load
from batchd.engine.models.model_fixture import FixtureSpec, make_model
from batchd.engine.models.registry import ensure_preset

# The parity tests' requests: tests/engine is no package, so its harness is imported from
# its folder, as pytest imports it there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from parity_harness import Req, random_requests, shared_prefix_requests  # noqa: E402

STORAGES: tuple[int | None, ...] = (None, 8, 4)
SEQUENCE_TOKENS = 1024

# SmolLM2-135M's shapes: 30 layers, 3 KV heads of 64 values.
SMOLLM2 = ModelSpec("llama", 30, 9, 3, 64, 49152, 8192, mx.float32, False)


@dataclass(frozen=True)
class Workload:
    """A parity set and the engine options its tests run it with."""

    requests: list[Req]
    options: dict[str, int]


def parity_set(model: str) -> Workload:
    """The requests of the parity tests of ``model`` (tiny or smollm2)."""
    if model == "tiny":
        return Workload(
            random_requests(32, seed=1, vocab=1024),
            {"max_num_seqs": 16, "max_num_batched_tokens": 512, "num_kv_blocks": 512},
        )
    vocab = 49152
    requests = random_requests(8, seed=1, vocab=vocab, prompt_len=(1, 60), max_tokens=(1, 12))
    requests += random_requests(12, seed=2, vocab=vocab, prompt_len=(20, 200), max_tokens=(1, 16))
    requests += shared_prefix_requests(12, seed=3, vocab=vocab)
    requests += random_requests(12, seed=4, vocab=vocab, prompt_len=(40, 160), max_tokens=(8, 24))
    return Workload(
        requests, {"max_num_seqs": 8, "max_num_batched_tokens": 256, "num_kv_blocks": 512}
    )


QUESTIONS = (
    "What is the capital of France, and what is it known for?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a cat watching the rain.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for a simple tomato soup.",
    "Why do leaves change colour in autumn?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "What is 17 times 23? Show your working.",
    "Describe the water cycle for a ten-year-old.",
    "Suggest a name for a bakery that sells only bread.",
    "What are the planets of the solar system, in order?",
    "Write a short, polite email declining a meeting invitation.",
    "Explain what a hash table is.",
)


def chat_set(loaded: LoadedModel) -> Workload:
    """Greedy chat answers (48 tokens) to a few everyday questions: natural text, where
    the parity set's random-token prompts leave the model near ties far more often."""
    template = loaded.tokenizer.apply_chat_template
    requests = [
        Req(tuple(template([{"role": "user", "content": q}], add_generation_prompt=True)), 48)
        for q in QUESTIONS
    ]
    return Workload(
        requests, {"max_num_seqs": 16, "max_num_batched_tokens": 512, "num_kv_blocks": 256}
    )


def budget_table(budget_mib: int) -> list[str]:
    """Markdown rows: the pool each storage plans within ``budget_mib`` of KV."""
    rows = [
        "| model dtype | KV storage | bytes a token | blocks (16 tokens) | "
        f"sequences of {SEQUENCE_TOKENS} tokens | vs float |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype in (mx.float32, mx.float16):
        spec = ModelSpec(**{**SMOLLM2.__dict__, "dtype": dtype})
        plain = 0
        for bits in STORAGES:
            plan = plan_pool(
                spec,
                block_size=16,
                max_num_seqs=4096,
                max_model_len=8192,
                tokens_per_seq=8192,
                memory_fraction=1.0,
                available_bytes=budget_mib * 2**20,
                quant=None if bits is None else KVQuant(bits, 64),
            )
            plain = plain or plan.blocks
            rows.append(
                f"| {str(dtype).removeprefix('mlx.core.')} | {plan.storage} | "
                f"{plan.block_bytes // 16} | {plan.blocks} | {plan.tokens // SEQUENCE_TOKENS} | "
                f"{plan.blocks / plain:.2f}x |"
            )
    return rows


def run(loaded: LoadedModel, work: Workload, bits: int | None, group: int) -> list[list]:
    """Each request's greedy (token, logprob) list through one engine, all at once."""
    config = EngineConfig(**work.options, kv_bits=bits, kv_group_size=group)
    eng = LLMEngine(loaded, config)
    outputs: list[list[tuple[int, float]]] = [[] for _ in work.requests]
    for i, req in enumerate(work.requests):
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        eng.add_request(f"r{i}", prompt_token_ids=list(req.prompt), params=params)
    while eng.has_unfinished():
        for out in eng.step():
            outputs[int(out.request_id[1:])].append((out.token_id, out.logprob))
    return outputs


def run_mlx_lm(loaded: LoadedModel, work: Workload, bits: int | None, group: int) -> list[list]:
    """The same, from mlx-lm alone, one request at a time, with a QuantizedKVCache from the
    first token (or its float cache): the engine's figures set against mlx-lm's own."""
    outputs = []
    for req in work.requests:
        layers = len(loaded.model.layers)
        cache = None if bits is None else [QuantizedKVCache(group, bits) for _ in range(layers)]
        steps = generate_step(
            mx.array(req.prompt), loaded.model, max_tokens=req.max_tokens, prompt_cache=cache
        )
        outputs.append([(int(t), float(lp[int(t)])) for t, lp in steps])
    return outputs


def compare(plain: list[list], quantized: list[list]) -> dict[str, float]:
    """Agreement of a quantized run with the float run (see the module's docstring)."""
    tokens = agreed = exact = 0
    firsts: list[int] = []
    deltas: list[float] = []
    for want, got in zip(plain, quantized, strict=True):
        tokens += len(want)
        pairs = enumerate(zip(want, got, strict=True))
        first = next((p for p, (a, b) in pairs if a[0] != b[0]), None)
        same = len(want) if first is None else first
        agreed += same
        exact += first is None
        if first is not None:
            firsts.append(first)
        deltas += [abs(a[1] - b[1]) for a, b in zip(want[:same], got[:same], strict=True)]
    return {
        "requests": len(plain),
        "exact": exact,
        "agreement": agreed / tokens,
        "first_divergence": min(firsts) if firsts else -1,
        "median_divergence": statistics.median(firsts) if firsts else -1,
        "mean_delta": statistics.fmean(deltas),
        "max_delta": max(deltas),
    }


def accuracy_table(
    loaded: LoadedModel, work: Workload, group: int, *, mlx_lm: bool = False
) -> list[str]:
    runner = run_mlx_lm if mlx_lm else run
    rows = [
        "| KV storage | exact requests | token agreement | first divergence (min / median) | "
        "mean abs delta logprob | max abs delta logprob |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    plain = runner(loaded, work, None, group)
    for bits in STORAGES[1:]:
        c = compare(plain, runner(loaded, work, bits, group))
        rows.append(
            f"| {bits}-bit, groups of {group} | {c['exact']}/{c['requests']} | "
            f"{100 * c['agreement']:.1f}% | {c['first_divergence']} / "
            f"{c['median_divergence']} | {c['mean_delta']:.4f} | {c['max_delta']:.4f} |"
        )
    return rows


def speed_table(loaded: LoadedModel, group: int, *, rounds: int) -> list[str]:
    """Markdown rows: output tokens/s of each storage on a decode-heavy batch (16
    requests of 128 prompt tokens and 64 outputs), best of ``rounds`` alternating rounds."""
    rng = random.Random(5)
    vocab = loaded.spec.vocab_size
    work = Workload(
        [Req(tuple(rng.randrange(4, vocab) for _ in range(128)), 64) for _ in range(16)],
        {"max_num_seqs": 16, "max_num_batched_tokens": 512, "num_kv_blocks": 256},
    )
    # Float KV on MLX's path too (the C kernels off), as a quantized pool runs: the
    # quantization's own cost apart from the kernels'.
    runs: list[tuple[str, int | None, bool]] = [("float", None, True)]
    runs.append(("float, MLX path (kernels off)", None, False))
    runs += [(f"{bits}-bit, groups of {group}", bits, True) for bits in STORAGES[1:]]
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, bits, kernels in runs:
            os.environ[native.DISABLE_ENV] = "1" if kernels else "0"
            start = time.perf_counter()
            tokens = sum(len(out) for out in run(loaded, work, bits, group))
            best[name] = max(best.get(name, 0.0), tokens / (time.perf_counter() - start))
    os.environ.pop(native.DISABLE_ENV)
    rows = ["| KV storage | output tokens/s | vs float |", "|---|---:|---:|"]
    for name, _, _ in runs:
        rows.append(f"| {name} | {best[name]:.0f} | {best[name] / best['float']:.2f}x |")
    return rows


def load_model(name: str, folder: Path) -> LoadedModel:
    if name == "tiny":
        return load(make_model(folder / "tiny", FixtureSpec(preset="tiny")))
    return load(ensure_preset("smollm2", path=folder / "smollm2", keep_quantized=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.kv_quant", description=__doc__)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--no-accuracy", action="store_true", help="the budget table only")
    p.add_argument(
        "--chat", action="store_true", help="everyday chat questions instead of the parity set"
    )
    p.add_argument(
        "--mlx-lm", action="store_true", help="mlx-lm's QuantizedKVCache instead of batchd"
    )
    p.add_argument("--group", type=int, help="kv_group_size (default: 64, or 32 for tiny)")
    p.add_argument(
        "--speed", type=int, metavar="ROUNDS", help="time each storage instead of the accuracy"
    )
    args = p.parse_args(argv)
    print(f"SmolLM2-135M's pool of KV blocks within {args.budget_mib} MiB:")
    print("\n".join(budget_table(args.budget_mib)))
    if args.no_accuracy:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(args.model, Path(tmp))
        work = chat_set(loaded) if args.chat else parity_set(args.model)
        # Groups of 64 as mlx-lm's default, or the largest that divides the heads.
        group = args.group or max(g for g in (32, 64) if loaded.spec.head_dim % g == 0)
        if args.speed:
            print(f"\n{args.model}: decode speed ({args.speed} rounds, best):")
            print("\n".join(speed_table(loaded, group, rounds=args.speed)))
            return 0
        name = "chat questions" if args.chat else "the parity set"
        name += ", mlx-lm alone" if args.mlx_lm else ""
        print(f"\n{args.model}: {name} ({len(work.requests)} requests), vs float KV:")
        print("\n".join(accuracy_table(loaded, work, group, mlx_lm=args.mlx_lm)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
