"""Speculative decoding (n-gram prompt lookup): outputs identical to decoding without it.

Every scenario runs the same requests through an engine with speculation off and one
with ``speculative="ngram"``, and compares each request's tokens, texts, logprobs and
finish reasons; the greedy ones are also held to mlx-lm's generate_step (the parity
harness's near-tie rule). The tiny random-weight models repeat themselves, and the
prompts repeat a few spans, so prompt lookup proposes often and both accepts and
rejects (checked: every scenario must exercise both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, served_greedy

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.forward import native
from batchd.engine.models.arch_fixture import make_arch_model
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.scheduling.schedule import ScheduledChunk
from batchd.engine.speculative import NgramIndex
from support.daemon_harness import DaemonProcess, daemon_config
from support.redis_server import RedisServer

VOCAB = 1024


@pytest.fixture(scope="module")
def llama(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    indexes: list[int] = field(default_factory=list)


@dataclass
class Run:
    results: list[Result]
    drafted: int
    accepted: int
    verify_chunks: int
    prefill_beside_verify: int


def _engine(loaded: LoadedModel, speculative: str, **options: object) -> LLMEngine:
    config: dict[str, object] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 96,
        "num_kv_blocks": 256,
        "block_size": 8,
        "speculative": speculative,
        # Unigram matches too: the random-weight model repeats short spans only.
        "speculative_ngram_min": 1,
    }
    config.update(options)
    return LLMEngine(loaded, EngineConfig(**config))  # type: ignore[arg-type]


def _run(
    eng: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    waves: int = 3,
    gap: int = 3,
    check_blocks: bool = True,
) -> Run:
    """Submit in waves (so verify chunks sit next to prefill chunks and plain decodes);
    check the block manager after every step."""
    per_wave = -(-len(prompts) // waves)
    pending = list(range(len(prompts)))
    results = [Result() for _ in prompts]
    step = verify = beside = 0
    bm = eng.scheduler.block_manager
    while pending or eng.has_unfinished():
        if pending and step % gap == 0:
            for i in pending[:per_wave]:
                eng.add_request(f"r{i}", prompt_token_ids=prompts[i], params=params[i])
            pending = pending[per_wave:]
        for out in eng.step():
            r = results[int(out.request_id[1:])]
            assert out.error is None
            r.tokens.append(out.token_id)
            r.text += out.text
            r.logprobs.append(out.logprob)
            r.indexes.append(out.index)
            if out.finished:
                assert r.finish is None, "an output after the request finished"
                r.finish = out.finish_reason.value if out.finish_reason else None
        kinds = eng.last_step_stats.chunks
        verifying = [c for c in kinds if c.kind == "decode" and c.num_tokens > 1]
        verify += len(verifying)
        if verifying:
            beside += sum(1 for c in kinds if c.kind == "prefill")
        if check_blocks:
            bm.check_invariants()
            for seq in eng.scheduler._running:
                # No block past the computed positions' (+ the next token's) survives a step.
                assert len(seq.block_table) <= bm.blocks_for(seq.num_computed_tokens + 1)
        step += 1
    assert bm.num_used_blocks == 0, "blocks leaked"
    return Run(results, eng.num_draft_tokens, eng.num_accepted_tokens, verify, beside)


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts made of a few spans repeated (so their n-grams recur), various lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        spans = [
            [rng.randrange(16, VOCAB) for _ in range(rng.randint(3, 12))]
            for _ in range(rng.randint(1, 3))
        ]
        prompt: list[int] = []
        for _ in range(rng.randint(2, 6)):
            prompt += rng.choice(spans)
        prompts.append(prompt[: rng.randint(4, 80)] or [17])
    return prompts


def _compare(off: Run, on: Run) -> None:
    for i, (a, b) in enumerate(zip(off.results, on.results, strict=True)):
        assert b.tokens == a.tokens, f"request {i}: tokens differ"
        assert b.text == a.text, f"request {i}: text differs"
        assert b.finish == a.finish, f"request {i}: finish reason differs"
        assert b.indexes == list(range(len(b.tokens)))
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    assert off.drafted == 0
    # The scenario exercised speculation: proposals accepted and proposals rejected,
    # verify chunks in steps that also carried prefill chunks.
    assert on.accepted > 0
    assert on.drafted > on.accepted
    assert on.verify_chunks > 0
    assert on.prefill_beside_verify > 0


@pytest.mark.parametrize("products", ["native", "mlx"])
def test_greedy_identical_to_off_and_to_mlx_lm(
    llama: LoadedModel, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if products == "mlx":
        monkeypatch.setenv(native.PRODUCTS_DISABLE_ENV, "0")
    prompts = _repetitive_prompts(20, seed=3)
    rng = random.Random(4)
    lengths = [rng.randint(1, 48) for _ in prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    off = _run(_engine(llama, "off"), prompts, params)
    on = _run(_engine(llama, "ngram"), prompts, params)
    _compare(off, on)
    reqs = [Req(tuple(p), n) for p, n in zip(prompts, lengths, strict=True)]
    report = check_parity(Reference(llama.model), reqs, [r.tokens for r in on.results])
    assert len(report.divergences) <= 1, report.divergences


def test_greedy_identical_generic_runner(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The generic path (mlx-lm's own forward over the pool) verifies drafts too."""
    loaded = load(make_arch_model(tmp_path_factory.mktemp("arch") / "gemma", "gemma"))
    assert loaded.spec.generic
    prompts = _repetitive_prompts(10, seed=5)
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    off = _run(_engine(loaded, "off"), prompts, params)
    on = _run(_engine(loaded, "ngram"), prompts, params)
    _compare(off, on)
    reqs = [Req(tuple(p), 24) for p in prompts]
    report = check_parity(Reference(loaded.model), reqs, [r.tokens for r in on.results])
    assert len(report.divergences) <= 1, report.divergences


def test_seeded_sampling_identical(llama: LoadedModel) -> None:
    """Sampled rows draw from (seed, output position) only: the verify positions draw
    what the decodes would have drawn, so seeded outputs match token for token."""
    prompts = _repetitive_prompts(16, seed=6)
    params = [
        SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            temperature=[0.3, 0.7, 1.0][i % 3],
            top_p=[1.0, 0.9][i % 2],
            top_k=[0, 20][i % 2],
            seed=100 + i,
            logprobs=2 if i % 4 == 0 else 0,
            logit_bias=((20, 3.0),) if i % 5 == 0 else (),
        )
        for i in range(len(prompts))
    ]
    off = _run(_engine(llama, "off"), prompts, params)
    on = _run(_engine(llama, "ngram"), prompts, params)
    _compare(off, on)


def test_stops_and_limits_inside_an_accepted_run(llama: LoadedModel) -> None:
    """max_tokens, stop token ids, stop strings and min_tokens that take effect in the
    middle of a verified run end the request exactly where decoding without it ends."""
    prompts = _repetitive_prompts(24, seed=8)
    # What the model says without speculation, to pick stops it will meet.
    plain = _run(
        _engine(llama, "off"),
        prompts,
        [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts],
    )
    eng = _engine(llama, "off")
    params = []
    for i, r in enumerate(plain.results):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=1 + i % 7, ignore_eos=True))
        elif kind == 1:
            params.append(
                SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(r.tokens[10],))
            )
        elif kind == 2:
            text = eng.tokenizer.decode(r.tokens)
            params.append(SamplingParams(max_tokens=40, ignore_eos=True, stop=(text[20:23],)))
        else:
            params.append(
                SamplingParams(
                    max_tokens=40, ignore_eos=True, stop_token_ids=(r.tokens[2],), min_tokens=9
                )
            )
    off = _run(_engine(llama, "off"), prompts, params)
    on = _run(_engine(llama, "ngram", speculative_ngram_min=1), prompts, params)
    _compare(off, on)
    assert {r.finish for r in on.results} == {"stop", "length"}


def test_per_request_opt_in_and_out(llama: LoadedModel) -> None:
    prompts = _repetitive_prompts(8, seed=9)
    opt_in = [SamplingParams(max_tokens=30, ignore_eos=True, speculative=True) for _ in prompts]
    opt_out = [SamplingParams(max_tokens=30, ignore_eos=True, speculative=False) for _ in prompts]
    base = _run(
        _engine(llama, "off"), prompts, [SamplingParams(max_tokens=30, ignore_eos=True)] * 8
    )
    on = _run(_engine(llama, "off"), prompts, opt_in)
    out = _run(_engine(llama, "ngram"), prompts, opt_out)
    assert on.drafted > 0 and out.drafted == 0
    assert [r.tokens for r in on.results] == [r.tokens for r in base.results]
    assert [r.tokens for r in out.results] == [r.tokens for r in base.results]


def test_penalties_and_grammar_rows_do_not_speculate(llama: LoadedModel) -> None:
    """Rows whose processors depend on the tokens before each position (penalties over the
    output, a grammar) decode one token a step, next to rows that speculate."""
    prompts = _repetitive_prompts(8, seed=10)
    params = [
        SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.5 if i % 2 else 0.0)
        for i in range(len(prompts))
    ]
    eng = _engine(llama, "ngram")
    drafted_for: set[str] = set()
    original = eng._propose

    def spy(seq, room):  # type: ignore[no-untyped-def]
        draft = original(seq, room)
        if draft:
            drafted_for.add(seq.request_id)
        return draft

    eng.scheduler.propose = spy
    on = _run(eng, prompts, params)
    off = _run(_engine(llama, "off"), prompts, params)
    assert [r.tokens for r in on.results] == [r.tokens for r in off.results]
    assert drafted_for and all(int(rid[1:]) % 2 == 0 for rid in drafted_for)


def test_rollback_with_a_tight_pool_and_preemption(llama: LoadedModel) -> None:
    """A pool small enough to preempt: drafts never take a block the pool lacks, rejected
    tails go back, and the outputs still match."""
    prompts = _repetitive_prompts(12, seed=11)
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    off = _run(
        _engine(llama, "off", num_kv_blocks=40, enable_prefix_caching=False), prompts, params
    )
    eng = _engine(llama, "ngram", num_kv_blocks=40, enable_prefix_caching=False)
    on = _run(eng, prompts, params)
    _compare(off, on)
    assert eng.last_step_stats.num_preemptions_total > 0


def test_verify_chunk_tokens_and_logit_rows(llama: LoadedModel) -> None:
    eng = _engine(llama, "ngram")
    eng.add_request("a", prompt_token_ids=[20, 21, 22, 20, 21], params=SamplingParams(max_tokens=8))
    eng.step()  # the prompt
    seq = next(iter(eng._live["a"].values()))
    chunk = ScheduledChunk(seq, seq.num_tokens - 1, 3, [0, 1, 2], True, (7, 8))
    assert chunk.token_ids == [seq.last_token, 7, 8]
    assert chunk.num_logits == 3 and chunk.is_decode and chunk.is_verify


def test_ngram_index() -> None:
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3]
    idx.update(tokens)
    # "1 2 3" occurred before, followed by 4 9 1 ...
    assert idx.propose(tokens, 3) == [4, 9, 1]
    tokens += [4]
    idx.update(tokens)
    assert idx.propose(tokens, 2) == [9, 1]
    # the latest earlier occurrence wins; a proposal stops at the sequence's end
    tokens = [5, 6, 5, 7, 5]
    idx = NgramIndex(1, 2)
    idx.update(tokens)
    assert idx.propose(tokens, 4) == [7, 5]
    assert NgramIndex(2, 3).propose([1, 2], 4) == []


def test_decode_rows_bound(llama: LoadedModel) -> None:
    """speculative_max_decode_rows bounds a step's decode rows, proposals included."""
    prompts = _repetitive_prompts(8, seed=12)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    eng = _engine(llama, "ngram", speculative_max_decode_rows=10)
    seen = []
    original = eng.step

    def step():  # type: ignore[no-untyped-def]
        out = original()
        seen.append(eng.last_step_stats.num_decode_tokens)
        return out

    eng.step = step  # type: ignore[method-assign]
    on = _run(eng, prompts, params, waves=1)
    off = _run(_engine(llama, "off"), prompts, params, waves=1)
    assert [r.tokens for r in on.results] == [r.tokens for r in off.results]
    assert on.drafted > 0 and max(seen) <= 10


def test_job_field_reaches_the_engine() -> None:
    from batchd.producers.schema import JobRequest

    job = JobRequest.model_validate({"prompt": "hi", "speculative": True})
    assert SamplingParams(**job.sampling()).speculative is True
    job = JobRequest.model_validate({"prompt": "hi"})
    assert SamplingParams(**job.sampling()).speculative is None


@pytest.mark.timeout(600)
def test_daemon_with_speculation_serves_the_same_tokens(
    tiny_model: Path, llama: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    """``batchd serve`` with engine.speculative = ngram: greedy jobs through Redis get the
    tokens the engine gives without speculation."""
    prompts = _repetitive_prompts(6, seed=13)
    reqs = [Req(tuple(p), 24) for p in prompts]
    daemon = DaemonProcess(
        daemon_config(tmp_path, redis_server.url),
        model=tiny_model,
        log_path=tmp_path / "d.log",
        env={"BATCHD_ENGINE__SPECULATIVE": "ngram", "BATCHD_ENGINE__SPECULATIVE_NGRAM_MIN": "1"},
    )
    served = served_greedy(daemon, redis_server.url, reqs)
    off = _run(
        _engine(llama, "off"),
        prompts,
        [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts],
    )
    assert [r.token_ids for r in served] == [r.tokens for r in off.results]
    assert "speculative decoding: ngram" in daemon.log_tail(200_000)


def test_proposals_never_crowd_out_a_decode(llama: LoadedModel) -> None:
    """With a step budget of exactly max_num_seqs tokens, every decoding sequence still
    decodes every step: proposals take only what the decodes leave."""
    prompts = _repetitive_prompts(8, seed=14)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    eng = _engine(llama, "ngram", max_num_batched_tokens=8, speculative_max_decode_rows=None)
    sched = eng.scheduler
    original = sched.schedule
    skipped = []

    def schedule():  # type: ignore[no-untyped-def]
        decoding = {s.seq_id for s in sched._running if s.num_tokens - s.num_computed_tokens == 1}
        out = original()
        scheduled = {c.seq.seq_id for c in out.chunks}
        preempted = {s.seq_id for s in out.preempted}
        skipped.extend(decoding - scheduled - preempted)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    on = _run(eng, prompts, params, waves=1)
    off = _run(_engine(llama, "off", max_num_batched_tokens=8), prompts, params, waves=1)
    assert [r.tokens for r in on.results] == [r.tokens for r in off.results]
    assert on.drafted > 0
    assert not skipped
