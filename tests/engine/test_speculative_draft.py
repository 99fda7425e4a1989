"""Speculative decoding with a draft model: outputs identical to decoding without it.

Two drafts for the tiny target: the target itself (its greedy proposals are the
target's greedy tokens, so nearly all are accepted) and the target with its weights
perturbed (same tokenizer; some proposals accepted, the rest rolled back). Whatever the
draft proposes, every request's tokens, texts, logprobs and finish reasons equal
those of an engine with speculation off (the helpers of test_speculative run both
and check the block manager after every step), and greedy ones equal mlx-lm's.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest
from parity_harness import Reference, Req, check_parity
from test_speculative import Run, _engine, _repetitive_prompts, _run

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.models.model_fixture import FixtureSpec, make_model, random_weights
from batchd.engine.speculative import DraftProposer

DRAFTS = ("self", "other")
# How much of another seed's weights the "other" draft adds to the target's.
NOISE = 0.05


@pytest.fixture(scope="module")
def llama(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


@pytest.fixture(scope="module")
def other_draft(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's directory (so its tokenizer) with its weights perturbed by
    those of another seed: a draft that agrees with the target only in part."""
    import json

    out = tmp_path_factory.mktemp("models") / "draft"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    target = mx.load(str(tiny_model / "model.safetensors"))
    noise = random_weights(config, seed=7)
    arrays = {k: v + NOISE * mx.array(noise[k]) for k, v in target.items()}  # type: ignore[union-attr]
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    return out


def _draft_path(name: str, tiny_model: Path, other_draft: Path) -> str:
    return str(tiny_model if name == "self" else other_draft)


def _mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Greedy rows beside rows that never speculate (opted out, or penalised)."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        kind = i % 4
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 40),
                ignore_eos=True,
                speculative=False if kind == 2 else None,
                presence_penalty=0.5 if kind == 3 else 0.0,
            )
        )
    return params


def _check_same(off: Run, on: Run) -> None:
    """Each request's tokens, text, finish reason and logprobs as without speculation."""
    assert [(r.tokens, r.text, r.finish) for r in on.results] == [
        (r.tokens, r.text, r.finish) for r in off.results
    ]
    assert all(r.indexes == list(range(len(r.tokens))) for r in on.results)
    for want, got in zip(off.results, on.results, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
    assert off.drafted == 0
    assert on.drafted > 0 and on.verify_chunks > 0


def _off_and_draft(
    llama: LoadedModel, draft: str, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[Run, Run, LLMEngine]:
    """The requests run with speculation off and with the draft model ``draft``; the
    draft engine is left with no draft cache of a finished sequence."""
    off = _run(_engine(llama, "off"), prompts, params)
    eng = _engine(llama, "draft", speculative_draft_model=draft)
    on = _run(eng, prompts, params)
    _check_same(off, on)
    assert isinstance(eng.proposer, DraftProposer)
    assert eng.proposer._caches == {}, "a finished sequence kept its draft cache"
    return off, on, eng


def _acceptance(eng: LLMEngine) -> float:
    stats = eng.last_step_stats
    assert stats.num_draft_tokens_total == eng.num_draft_tokens
    assert stats.num_accepted_tokens_total == eng.num_accepted_tokens
    return stats.acceptance_rate


@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_identical_to_off_and_to_mlx_lm(
    llama: LoadedModel, tiny_model: Path, other_draft: Path, draft: str
) -> None:
    prompts = _repetitive_prompts(16, seed=21)
    params = _mixed_params(len(prompts), seed=22)
    _, on, eng = _off_and_draft(llama, _draft_path(draft, tiny_model, other_draft), prompts, params)
    rate = _acceptance(eng)
    if draft == "self":
        # The target proposing its own greedy tokens: only float noise between its
        # one-row and batched forwards could reject one.
        assert rate >= 0.95, rate
    else:
        assert 0 < on.accepted < on.drafted  # accepted runs and rolled-back tails
    greedy = [i for i, p in enumerate(params) if p.presence_penalty == 0]
    reqs = [Req(tuple(prompts[i]), params[i].max_tokens) for i in greedy]
    outputs = [on.results[i].tokens for i in greedy]
    report = check_parity(Reference(llama.model), reqs, outputs)
    assert len(report.divergences) <= 1, report.divergences


@pytest.mark.parametrize("draft", DRAFTS)
def test_seeded_sampling_identical(
    llama: LoadedModel, tiny_model: Path, other_draft: Path, draft: str
) -> None:
    prompts = _repetitive_prompts(12, seed=23)
    base = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)
    params = [
        dataclasses.replace(base, temperature=(0.3, 0.7, 1.0)[i % 3], top_p=1 - i % 2 / 10, seed=i)
        for i in range(len(prompts))
    ]
    _, on, eng = _off_and_draft(llama, _draft_path(draft, tiny_model, other_draft), prompts, params)
    assert 0 < on.accepted < on.drafted  # a greedy proposal is not always the token drawn


def test_preemption_drops_the_draft_cache(llama: LoadedModel, tiny_model: Path) -> None:
    """A pool small enough to preempt: a preempted sequence's draft cache goes, and is
    rebuilt from its tokens when it runs again; outputs still match."""
    prompts = _repetitive_prompts(10, seed=24)
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    tight = {"num_kv_blocks": 40, "enable_prefix_caching": False}
    off = _run(_engine(llama, "off", **tight), prompts, params)
    eng = _engine(llama, "draft", speculative_draft_model=str(tiny_model), **tight)
    dropped: list[str] = []
    assert isinstance(eng.proposer, DraftProposer)
    original = eng.proposer.drop

    def drop(seq_id: str) -> None:
        if seq_id in eng.proposer._caches:  # type: ignore[union-attr]
            dropped.append(seq_id)
        original(seq_id)

    eng.proposer.drop = drop  # type: ignore[method-assign]
    on = _run(eng, prompts, params)
    _check_same(off, on)
    assert eng.last_step_stats.num_preemptions_total > 0
    assert len(dropped) > len(prompts), "no preempted sequence's draft cache was dropped"
    assert eng.proposer._caches == {}


def test_draft_of_another_tokenizer_refused_at_start(
    llama: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Same vocabulary size, another tokenizer (a fixture of another seed trains its
    own): refused when the engine starts, naming the option."""
    other = make_model(tmp_path_factory.mktemp("models") / "seed1", FixtureSpec(seed=1))
    config = EngineConfig(speculative="draft", speculative_draft_model=str(other))
    with pytest.raises(ValueError, match="speculative_draft_model .* share the target's tok"):
        LLMEngine(llama, config)


def test_draft_method_needs_a_model() -> None:
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(speculative="draft", speculative_draft_model="")


def test_proposals_continue_the_sequence_greedily(llama: LoadedModel, tiny_model: Path) -> None:
    """The draft's k tokens are mlx-lm's greedy continuation of the sequence's tokens,
    also after a rejected tail is trimmed from its cache."""
    eng = _engine(llama, "draft", speculative_draft_model=str(tiny_model))
    proposer = eng.proposer
    assert isinstance(proposer, DraftProposer)
    ref = Reference(llama.model)
    prompt = [20, 21, 22, 20, 21, 300, 301]
    want, _ = ref.run(Req(tuple(prompt), 8))
    eng.add_request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=8))
    seq = next(iter(eng._live["a"].values()))
    assert proposer.propose(seq, 4) == want[:4]
    # As if only the first proposal was accepted and a different token sampled after it.
    seq.append_token(want[0])
    seq.append_token((want[1] + 1) % 1000)
    cont, _ = ref.run(Req(tuple(seq.tokens_view()), 3))
    assert proposer.propose(seq, 3) == cont
    assert proposer._caches[seq.seq_id].tokens == seq.tokens_view() + cont[:2]
