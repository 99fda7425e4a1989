"""Speculative decoding, LoRA adapters and quantized KV blocks combined with each other
and with the engine's other features.

The oracle of each cell: the same requests on the same model with the feature under
test off give the same greedy tokens (and, for speculation, the same seeded sampled
tokens, logprobs, top logprobs and prompt logprobs). With ``kv_bits`` the reference
keeps the same ``kv_bits`` (quantizing changes tokens by itself); with adapters it
keeps the same adapter rows. Every step checks the block manager's invariants, and
every run must end with its blocks back in the pool.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.tuner.utils import load_adapters
from parity_harness import Req
from test_kv_quant import GROUP
from test_kv_quant import _reference as quantized_reference
from test_lora import BETA
from test_speculative import _engine, _repetitive_prompts

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.adapters.adapter_fixture import make_adapter
from batchd.engine.forward import native
from batchd.engine.models.arch_fixture import VOCAB as ARCH_VOCAB
from batchd.engine.models.arch_fixture import WINDOW, make_arch_model
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import Sequence
from support.blas_rounding import quantized_gap

ADAPTERS: tuple[str | None, ...] = (None, "alpha", "beta")
KV8 = {"kv_bits": 8, "kv_group_size": GROUP}


@pytest.fixture(scope="module")
def llama(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


@pytest.fixture(scope="module")
def adapters(llama: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("combo-adapters")
    return {
        "alpha": str(make_adapter(root / "alpha", llama.model, seed=1)),
        "beta": str(make_adapter(root / "beta", llama.model, **BETA)),  # type: ignore[arg-type]
    }


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(make_arch_model(tmp_path_factory.mktemp("arch") / "exaone_moe", "exaone_moe"))


@pytest.fixture(params=["native", "mlx"])
def products(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The packed C products (float32 on a CPU), or MLX's."""
    if request.param == "mlx":
        monkeypatch.setenv(native.PRODUCTS_DISABLE_ENV, "0")
    return str(request.param)


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    adapter: str | None = None
    samples: int = 1  # engine-level n: samples 0..n-1 of one request (seed + sample)


@dataclass
class Out:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    finish: str | None = None
    cached: int = 0


@dataclass
class Served:
    outs: dict[tuple[int, int], Out]
    drafted: int
    accepted: int
    preemptions: int


def _serve(eng: LLMEngine, jobs: list[Job], *, waves: int = 2, gap: int = 3) -> Served:
    """Submit ``jobs`` in waves a few steps apart, run to the end checking the block
    manager after every step; each (job, sample)'s outputs."""
    outs: dict[tuple[int, int], Out] = {}
    per_wave = -(-len(jobs) // waves)
    pending = list(range(len(jobs)))
    bm = eng.scheduler.block_manager
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % gap == 0:
            for i in pending[:per_wave]:
                job = jobs[i]
                for s in range(job.samples):
                    params = job.params
                    if job.samples > 1 and params.seed is not None:
                        params = dataclasses.replace(params, seed=params.seed + s)
                    eng.add_request(
                        f"j{i}",
                        prompt_token_ids=job.prompt,
                        params=params,
                        adapter=job.adapter,
                        sample=s,
                    )
                    outs[(i, s)] = Out()
            pending = pending[per_wave:]
        for o in eng.step():
            assert o.error is None, o.error
            out = outs[(int(o.request_id[1:]), o.sample)]
            assert out.finish is None, "an output after the request finished"
            assert o.index == len(out.tokens)
            out.tokens.append(o.token_id)
            out.logprobs.append(o.logprob)
            out.top.append(list(o.top_logprobs or []))
            if o.prompt_logprobs is not None:
                out.prompt_logprobs = list(o.prompt_logprobs)
            if o.index == 0:
                out.cached = o.cached_tokens
            if o.finished:
                out.finish = o.finish_reason.value if o.finish_reason else None
        bm.check_invariants()
        for seq in eng.scheduler._running:
            assert len(seq.block_table) <= bm.blocks_for(seq.num_computed_tokens + 1)
        step += 1
    assert bm.num_used_blocks == 0, "blocks leaked"
    stats = eng.last_step_stats
    return Served(outs, eng.num_draft_tokens, eng.num_accepted_tokens, stats.num_preemptions_total)


def _same(
    off: Served,
    on: Served,
    *,
    speculated: bool = True,
    accepts: bool = True,
    logprob_abs: float = 1e-3,
) -> None:
    """Tokens, finish reasons, logprobs (top and prompt ones too) as in the reference,
    within ``logprob_abs`` (wider for an 8-bit KV cache: support.blas_rounding)."""
    assert on.outs.keys() == off.outs.keys()
    for key, want in off.outs.items():
        got = on.outs[key]
        assert got.tokens == want.tokens, f"job {key}: tokens differ"
        assert got.finish == want.finish, f"job {key}: finish differs"
        assert got.logprobs == pytest.approx(want.logprobs, abs=logprob_abs), f"job {key}"
        assert [[t for t, _ in row] for row in got.top] == [
            [t for t, _ in row] for row in want.top
        ], f"job {key}: top logprob tokens differ"
        for g, w in zip(got.top, want.top, strict=True):
            assert [v for _, v in g] == pytest.approx([v for _, v in w], abs=logprob_abs)
        if want.prompt_logprobs is None:
            assert got.prompt_logprobs is None
        else:
            assert got.prompt_logprobs == pytest.approx(want.prompt_logprobs, abs=logprob_abs)
    if speculated:
        assert off.drafted == 0
        assert on.drafted > 0, "nothing was proposed"
        # The random-weight model seldom repeats itself: prompt lookup's proposals are
        # mostly rejected there, a self-draft's mostly accepted.
        assert on.accepted > 0 or not accepts, "no proposal was accepted"


def _spec(
    loaded: LoadedModel,
    method: str,
    model_path: Path,
    reference: Served | None = None,
    **options: object,
) -> LLMEngine:
    """An engine speculating with ``method``: ``ngram``; ``draft`` (the target as its own
    draft: a separate instance, so with no adapter installed); ``oracle``: proposals read
    from ``reference`` (the tokens the engine without speculation gave each sample), the
    last one of every third proposal made wrong. Only the oracle makes the proposals of
    adapter rows and sampled rows accepted often, so that the verify positions after
    the first decide tokens."""
    if method == "draft":
        options = {"speculative_draft_model": str(model_path), **options}
    eng = _engine(loaded, "ngram" if method == "oracle" else method, **options)
    if method == "oracle":
        assert reference is not None
        k = eng.config.num_speculative_tokens

        def propose(seq: Sequence, room: int) -> list[int]:
            want = reference.outs[(int(seq.request_id[1:]), seq.sample)].tokens
            n = seq.num_output_tokens
            draft = list(want[n : n + min(room, k)])
            if draft and n % 3 == 2:
                draft[-1] ^= 1
            return draft

        eng.proposer.propose = propose  # type: ignore[method-assign]
    return eng


METHODS = ["ngram", "draft", "oracle"]


def _adapter_jobs(n: int, seed: int, max_tokens: int = 20) -> list[Job]:
    """Base and adapter rows, greedy ones, ones with top logprobs, with prompt logprobs,
    and seeded sampled ones."""
    prompts = _repetitive_prompts(n, seed=seed)
    kinds = [
        {},
        {"logprobs": 3},
        {"prompt_logprobs": True},
        {"temperature": 0.8, "seed": 40 + seed},
    ]
    return [
        Job(
            p,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % 4]),  # type: ignore[arg-type]
            ADAPTERS[i % 3],
        )
        for i, p in enumerate(prompts)
    ]


# -- 1. speculation x LoRA rows -------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_mixed_adapter_rows(
    llama: LoadedModel, tiny_model: Path, adapters: dict[str, str], method: str, products: str
) -> None:
    jobs = _adapter_jobs(6, seed=31)
    off = _serve(_engine(load(tiny_model), "off", adapters=adapters), jobs)
    on = _serve(_spec(load(tiny_model), method, tiny_model, off, adapters=adapters), jobs)
    _same(off, on, accepts=method != "ngram")
    # The adapters changed the tokens (a verify chunk without its row's delta could not
    # match): the same prompts on the base model differ somewhere.
    base = _serve(_engine(llama, "off"), [Job(j.prompt, j.params) for j in jobs])
    assert any(base.outs[(i, 0)].tokens != off.outs[(i, 0)].tokens for i in (1, 2, 4, 5))
    assert base.outs[(2, 0)].prompt_logprobs != off.outs[(2, 0)].prompt_logprobs


# -- 2. speculation x kv_bits 8 --------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_quantized_kv(
    llama: LoadedModel, tiny_model: Path, method: str, bits: int, products: str
) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    jobs = [Job(p, params) for p in _repetitive_prompts(6, seed=32)]
    kv = {"kv_bits": bits, "kv_group_size": GROUP}
    off = _serve(_engine(llama, "off", **kv), jobs)
    on = _serve(_spec(llama, method, tiny_model, off, **kv), jobs)
    _same(off, on, accepts=method != "ngram")


# -- 3. LoRA x kv_bits 8 ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [None, 8])
def test_adapters_with_quantized_kv(
    llama: LoadedModel, tiny_model: Path, adapters: dict[str, str], bits: int | None
) -> None:
    """Each row's tokens and prompt logprobs equal mlx-lm's with its adapter applied and
    a QuantizedKVCache (kv_bits 8) or its float cache (None)."""
    rng = random.Random(33)
    prompts = [[rng.randrange(4, 1024) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=True)
    jobs = [Job(p, params, a) for p in prompts for a in ADAPTERS]
    kv = {} if bits is None else {"kv_bits": bits, "kv_group_size": GROUP}
    got = _serve(_engine(load(tiny_model), "off", adapters=adapters, **kv), jobs, waves=1)
    for name in ADAPTERS:
        model = load(tiny_model).model
        if name is not None:
            load_adapters(model, adapters[name])
        model.eval()
        for i, job in enumerate(jobs):
            if job.adapter != name:
                continue
            out = got.outs[(i, 0)]
            want, _ = quantized_reference(model, Req(tuple(job.prompt), 10), bits)
            assert out.tokens == want, f"job {i} ({name})"
            cache = None if bits is None else [QuantizedKVCache(GROUP, bits) for _ in model.layers]
            logits = model(mx.array(job.prompt)[None], cache=cache)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs[:-1], mx.array(job.prompt[1:])[:, None], axis=-1)
            each = 2e-3 if bits is None else quantized_gap().each
            assert out.prompt_logprobs == pytest.approx(picked[:, 0].tolist(), abs=each), i


# -- 4. speculation x n > 1, x prompt logprobs, x top logprobs -------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_samples_and_logprobs(
    llama: LoadedModel, tiny_model: Path, method: str
) -> None:
    prompts = _repetitive_prompts(4, seed=34)
    jobs = [
        # n = 3 seeded samples of one request (each sample its own seed).
        Job(
            prompts[0],
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=5),
            samples=3,
        ),
        # n = 2 greedy samples: the second takes the first's prompt blocks.
        Job(prompts[1], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3), samples=2),
        Job(
            prompts[2],
            SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=True, logprobs=2),
        ),
        Job(
            prompts[3],
            SamplingParams(
                max_tokens=16,
                ignore_eos=True,
                temperature=1.0,
                seed=9,
                logprobs=3,
                prompt_logprobs=True,
            ),
        ),
    ]
    off = _serve(_engine(llama, "off"), jobs)
    on = _serve(_spec(llama, method, tiny_model, off), jobs)
    _same(off, on, accepts=method != "ngram")


# -- 5. speculation x sliding window, x prefix-cache hits -------------------------------------


@pytest.mark.parametrize("method", ["ngram", "oracle"])
@pytest.mark.parametrize("pool", ["roomy", "tight", "kv8"])
def test_speculation_on_a_sliding_window_model(
    windowed: LoadedModel, tmp_path_factory: pytest.TempPathFactory, pool: str, method: str
) -> None:
    """Every layer windowed: blocks released behind the window, then rejected tails cut
    back by truncate, in the same sequences; prompts sharing a prefix (prefix-cache
    hits), a request of n = 2, adapter rows and (tight) preemption beside."""
    rng = random.Random(35)
    head = [rng.randrange(4, ARCH_VOCAB) for _ in range(WINDOW + 10)]
    prompts = []
    for i in range(5):
        span = [rng.randrange(4, ARCH_VOCAB) for _ in range(rng.randint(3, 8))]
        tail = (span * 12)[: rng.randint(4, 2 * WINDOW)]
        prompts.append(head + tail if i % 2 else tail + span)
    params = SamplingParams(max_tokens=2 * WINDOW, ignore_eos=True)
    root = tmp_path_factory.mktemp("window-adapters")
    keys = ("self_attn.q_proj", "self_attn.v_proj")
    adapter = {"alpha": str(make_adapter(root / "alpha", windowed.model, seed=1, keys=keys))}
    jobs = [
        Job(p, params, "alpha" if i == 3 else None, 2 if i == 1 else 1)
        for i, p in enumerate(prompts)
    ]
    options: dict[str, object] = {"num_kv_blocks": 20 if pool == "tight" else 64}
    path = tmp_path_factory.mktemp("arch") / "exaone_moe"
    if pool == "kv8":
        # Heads of 32 values: the smallest quantization group fits them.
        shape = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
        model = make_arch_model(path, "exaone_moe", overrides=shape)
        options.update(KV8)
        jobs = [Job(j.prompt, j.params, None, j.samples) for j in jobs]
    else:
        model = make_arch_model(path, "exaone_moe")
        options["adapters"] = adapter
    off = _serve(_engine(load(model), "off", **options), jobs)
    eng = _spec(load(model), method, model, off, **options)
    on = _serve(eng, jobs)
    _same(off, on, logprob_abs=quantized_gap().each if pool == "kv8" else 1e-3)
    assert eng.scheduler.block_manager.num_window_releases > 0
    if pool == "tight":
        assert off.preemptions > 0
    else:
        assert eng.scheduler.block_manager.hit_rate > 0


@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_adapters_on_the_generic_path(
    tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    path = make_arch_model(tmp_path_factory.mktemp("arch") / "olmo2", "olmo2")
    root = tmp_path_factory.mktemp("olmo2-adapters")
    shapes = load(path).model
    adapters = {
        "alpha": str(make_adapter(root / "alpha", shapes, seed=1)),
        "beta": str(make_adapter(root / "beta", shapes, **BETA)),  # type: ignore[arg-type]
    }
    prompts = [[t % ARCH_VOCAB for t in p] for p in _repetitive_prompts(6, seed=38)]
    jobs = [
        Job(p, SamplingParams(max_tokens=20, ignore_eos=True), ADAPTERS[i % 3])
        for i, p in enumerate(prompts)
    ]
    off = _serve(_engine(load(path), "off", adapters=adapters), jobs)
    on = _serve(_spec(load(path), method, path, off, adapters=adapters), jobs)
    _same(off, on, accepts=method != "ngram")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prefix_cache_hits_after_speculation(
    llama: LoadedModel, tiny_model: Path, method: str
) -> None:
    """A request that ran with speculation leaves its prompt's and output's full blocks
    cached; a later request over its prompt and output reuses them and gets the tokens
    the engine without speculation gives it."""
    prompt = _repetitive_prompts(1, seed=36)[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for mode in ("off", method):
        eng = _spec(llama, mode, tiny_model) if mode != "off" else _engine(llama, "off")
        first = _serve(eng, [Job(prompt, params)], waves=1)
        tokens = first.outs[(0, 0)].tokens
        later = [Job(prompt, params), Job(prompt + tokens[:17], params)]
        second = _serve(eng, later, waves=1)
        assert second.outs[(0, 0)].tokens == tokens
        assert second.outs[(1, 0)].cached >= len(prompt) + 16 - 8
        outputs[mode] = (first, second)
    _same(outputs["off"][1], outputs[method][1], speculated=False)
    assert outputs[method][0].drafted > 0


# -- 6. speculation x preemption (tight pool) x LoRA -----------------------------------------


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_speculation_with_preemption_and_adapters(
    llama: LoadedModel, tiny_model: Path, adapters: dict[str, str], method: str, caching: bool
) -> None:
    jobs = _adapter_jobs(8, seed=37, max_tokens=32)
    tight = {"num_kv_blocks": 24, "enable_prefix_caching": caching, "adapters": adapters}
    off = _serve(_engine(load(tiny_model), "off", **tight), jobs, waves=1)
    on = _serve(_spec(load(tiny_model), method, tiny_model, off, **tight), jobs, waves=1)
    assert on.preemptions > 0
    _same(off, on, accepts=method != "ngram")


def test_a_proposal_never_takes_a_block_a_later_decode_needs() -> None:
    """Two decodes each about to need a new block, one free block each: the first one's
    proposal used to take both (its check saw only the free count) and preempted the
    second. Proposals now stop at the blocks the step's later chunks leave spare."""
    config = EngineConfig(block_size=4, num_kv_blocks=4, max_num_batched_tokens=32)
    sched = Scheduler(config, num_blocks=4, max_model_len=64, propose=lambda seq, room: [7] * room)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for name in "ab":
        sched.add(Sequence(f"{name}/0", [1, 2, 3, 4], params, request_id=name))
    sched.update(sched.schedule(), {"a/0": 9, "b/0": 9})
    out = sched.schedule()
    assert not out.preempted and sched.num_preemptions == 0
    assert [(c.seq.seq_id, c.draft) for c in out.chunks] == [("a/0", (7,) * 3), ("b/0", (7,) * 3)]
    sched.update(out, {"a/0": [7, 7, 7, 1], "b/0": [7, 2]})
    sched.block_manager.check_invariants()
    assert [len(s.block_table) for s in sched._running] == [2, 2]
