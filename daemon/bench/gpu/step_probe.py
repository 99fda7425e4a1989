"""Where an engine step's time goes on a GPU, against mlx-lm's forward of the same work.

Run on a machine where MLX runs on CUDA (config/gpu/run_checks.sh runs it):
``python3 -m batchd.daemon.bench.gpu.step_probe [--layers N] [--rows R] [--prompt P]``.
The bench's 8B shape (``--preset bench-llama8b``) with N of its layers, random weights:

- batchd steps: a P-token prompt alone, R rows decoding, and R rows decoding beside a
  P-token prompt (the mixed workload's commonest heavy step), each with the step's
  forward and wait-for-device parts; then R rows decoding beside prompts of a new
  length each time, as a continuous batch meets them, prefill buckets off and on;
- mlx-lm's own forward of the same shapes (a P-token prompt; R rows decoding one token);
- one layer's parts at P rows (the products, MLX's causal attention, the pool's write),
  and prefill attention bucketed against not (they must agree);
- a profile of batchd's mixed steps (host functions by own time).

A batchd step far slower than mlx-lm's forward of the same tokens, with the parts fast, is
host work or waiting between launches; the profile says which.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.daemon.bench.gpu.timing import median_ms
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.forward.paged_attention import make_prefill_chunk, prefill_attention
from batchd.engine.models.arch_fixture import make_arch_model
from batchd.engine.models.loader import load
from batchd.engine.models.presets import ARCH_PRESETS, FIXTURE_PRESETS

REPEATS = 5
# Tokens each decoding row makes: enough for every timed step that follows its prefill.
DECODE_TOKENS = 256
# Prompts of a new length each (up to LONGEST tokens: some split over steps) beside the
# decoding rows, with prefill buckets off and on (batchd.engine.forward.prefill_buckets).
NEW_SHAPES = 8
LONGEST = 1024


def _timed(label: str, run: Callable[[], object]) -> None:
    print(f"{label:38} ms {median_ms(run, repeats=REPEATS):8.2f}")


class Steps:
    """An engine fed random prompts, its steps timed one by one."""

    def __init__(self, engine: LLMEngine, vocab: int) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(0)
        self.vocab = vocab
        self.count = 0

    def add(self, prompt: int, max_tokens: int) -> None:
        ids = self.rng.integers(16, self.vocab, size=prompt).tolist()
        self.count += 1
        self.engine.add_request(
            f"r{self.count}",
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )

    def step(self) -> tuple[float, int, float, float]:
        """(wall ms, prefill tokens, forward ms, device-wait ms) of one step."""
        start = time.perf_counter()
        self.engine.step()
        wall = (time.perf_counter() - start) * 1e3
        stats = self.engine.last_step_stats
        return wall, stats.num_prefill_tokens, stats.forward_time_s * 1e3, stats.sync_wait_s * 1e3


def _line(name: str, timed: list[tuple[float, int, float, float]]) -> None:
    walls = [t[0] for t in timed]
    forwards = [t[2] for t in timed]
    waits = [t[3] for t in timed]
    print(
        f"{name:38} steps {len(timed):3}  wall ms median {statistics.median(walls):8.2f} "
        f"(min {min(walls):8.2f}, mean {statistics.fmean(walls):8.2f})  "
        f"forward {statistics.median(forwards):8.2f}  wait {statistics.median(waits):8.2f}"
    )


def probe_engine(steps: Steps, rows: int, prompt: int) -> None:
    """batchd's steps: a prompt alone, decodes alone, decodes beside a prompt."""
    alone = []
    for _ in range(REPEATS + 1):
        steps.add(prompt, 1)
        while steps.engine.has_unfinished():
            timed = steps.step()
            if timed[1]:
                alone.append(timed)
    _line(f"prompt of {prompt} alone", alone[1:])
    for _ in range(rows - 1):
        steps.add(128, DECODE_TOKENS)
    while True:
        if steps.step()[1] == 0:
            break
    _line(f"{rows - 1} rows decoding", [steps.step() for _ in range(16)])
    mixed = []
    profile = cProfile.Profile()
    for _ in range(REPEATS + 1):
        steps.add(prompt, 1)
        profile.enable()
        timed = steps.step()
        profile.disable()
        mixed.append(timed)
        while steps.step()[1]:
            pass
    _line(f"{rows - 1} decoding + prompt of {prompt}", mixed[1:])
    runner = steps.engine.runner
    for bucketed in (False, True):
        runner.bucket_prefill = bucketed
        new_shapes: list[tuple[float, int, float, float]] = []
        for length in steps.rng.integers(prompt // 4, LONGEST, size=NEW_SHAPES):
            steps.add(int(length), 1)
            while (step := steps.step())[1]:
                new_shapes.append(step)
        label = f"{rows - 1} decoding + new lengths, buckets {'on' if bucketed else 'off'}"
        _line(label, new_shapes)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print("profile of the mixed steps (own time):")
    lines = text.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if "ncalls" in line)
    print("\n".join(lines[header:]))


def probe_mlx_lm(model: Any, rows: int, prompt: int, vocab: int) -> None:
    """mlx-lm's forward of the same shapes, with its own caches."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.random.randint(16, vocab, (1, prompt))

    def prefill() -> mx.array:
        return model(ids, cache=make_prompt_cache(model))

    _timed(f"mlx-lm prompt of {prompt}", prefill)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(16, vocab, (rows - 1, 128)), cache=cache))
    token = mx.random.randint(16, vocab, (rows - 1, 1))

    def decode() -> mx.array:
        return model(token, cache=cache)

    _timed(f"mlx-lm {rows - 1} rows decoding", decode)


def probe_parts(engine: LLMEngine, prompt: int) -> None:
    """One layer's products, causal attention and pool write at ``prompt`` rows."""
    layer = engine.model.layers[0]
    spec = engine.spec
    h = mx.random.normal((prompt, layer.mlp.gate_proj.weight.shape[1])).astype(spec.dtype)
    heads_out = mx.random.normal((prompt, spec.num_heads * spec.head_dim)).astype(spec.dtype)
    attn, mlp = layer.self_attn, layer.mlp
    q = mx.random.normal((1, spec.num_heads, prompt, spec.head_dim)).astype(spec.dtype)
    kv = mx.random.normal((1, spec.num_kv_heads, prompt, spec.head_dim)).astype(spec.dtype)
    slots = mx.arange(prompt)
    k_new = kv[0]

    def products() -> list[mx.array]:
        return [attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), attn.o_proj(heads_out), mlp(h)]

    def sdpa() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.1, mask="causal")

    def write() -> list[mx.array]:
        engine.pool.write(0, slots, k_new, k_new)
        return [engine.pool.k[0], engine.pool.v[0]]

    for name, run in (("products", products), ("causal attention", sdpa), ("pool write", write)):
        _timed(f"one layer at {prompt} rows: {name}", run)


def probe_bucket_agreement(engine: LLMEngine) -> None:
    """Prefill attention over a cached prefix and of a fresh prompt, bucketed and not, on
    the same random K/V blocks in the model's dtype: the two must agree."""
    spec, bs = engine.spec, engine.pool.block_size
    blocks = 64
    shape = (spec.num_kv_heads, blocks, bs, spec.head_dim)
    k_blocks, v_blocks = (mx.random.normal(shape).astype(spec.dtype) for _ in range(2))
    table = np.random.default_rng(1).permutation(blocks).tolist()
    for start, n in ((0, 200), (300, 200)):
        q = mx.random.normal((n, spec.num_heads, spec.head_dim)).astype(spec.dtype)
        k_new, v_new = (
            mx.random.normal((spec.num_kv_heads, n, spec.head_dim)).astype(spec.dtype)
            for _ in range(2)
        )
        outs = [
            prefill_attention(
                q,
                k_new,
                v_new,
                k_blocks,
                v_blocks,
                make_prefill_chunk(0, start, n, table, block_size=bs, bucketed=bucketed),
                scale=spec.head_dim**-0.5,
            ).astype(mx.float32)
            for bucketed in (False, True)
        ]
        diff = mx.abs(outs[0] - outs[1]).max().item()
        print(f"prefill attention at {start}+{n}, bucketed vs not: max |difference| {diff:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = FIXTURE_PRESETS | ARCH_PRESETS
    parser.add_argument("--preset", default="bench-llama8b", choices=sorted(shapes))
    parser.add_argument("--layers", type=int, default=8, help="layers of the preset's shape")
    parser.add_argument("--rows", type=int, default=64, help="the engine's max_num_seqs")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens, the step budget")
    parser.add_argument("--async-scheduling", action="store_true", help="the engine's option")
    args = parser.parse_args()
    shape = {"model_type": "llama"} | shapes[args.preset] | {"num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = make_arch_model(Path(folder), shape["model_type"], overrides=shape)
        loaded = load(path)
        print(f"built and loaded {args.layers} layers in {time.perf_counter() - start:.1f}s")
    config = EngineConfig(
        max_num_seqs=args.rows,
        max_num_batched_tokens=args.prompt,
        num_kv_blocks=args.rows * (128 + DECODE_TOKENS) // 16 + 4 * LONGEST // 16 + 64,
        max_model_len=LONGEST + 128 + DECODE_TOKENS,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
    )
    engine = LLMEngine(loaded, config)
    print(f"backend: {engine.backend.describe()}")
    vocab = int(shape["vocab_size"])
    probe_parts(engine, args.prompt)
    probe_bucket_agreement(engine)
    probe_mlx_lm(loaded.model, args.rows, args.prompt, vocab)
    probe_engine(Steps(engine, vocab), args.rows, args.prompt)


if __name__ == "__main__":
    main()
