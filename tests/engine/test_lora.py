"""LoRA adapters per request: rows of different adapters and of the base model in one
packed batch, each greedy-equal to mlx-lm with that adapter applied
(mlx_lm.tuner.utils.load_adapters), on both forward paths; the prefix cache keyed by
adapter; the resident cache's LRU eviction that never drops an adapter in use."""

from __future__ import annotations

import random
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from mlx_lm.tuner.utils import load_adapters
from parity_harness import Reference, Req, check_parity

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.adapters.adapter_fixture import make_adapter
from batchd.engine.adapters.weights import AdapterError
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.models.arch_fixture import make_arch_model
from batchd.engine.models.loader import load

VOCAB = 1024
# The second adapter: another rank and scale, fewer layers and projections.
BETA = {
    "seed": 2,
    "rank": 4,
    "scale": 3.0,
    "keys": ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
    "num_layers": 1,
}


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = load(tiny_model).model
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": make_adapter(root / "alpha", model, seed=1),
        "beta": make_adapter(root / "beta", model, **BETA),  # type: ignore[arg-type]
    }


def _reference(model_path: Path, adapter: Path | None) -> Reference:
    model = load(model_path).model
    if adapter is not None:
        load_adapters(model, str(adapter))
    model.eval()
    return Reference(model)


def _serve(eng: LLMEngine, jobs: list[tuple[Req, str | None]]) -> list[list[int]]:
    """Every job added before the first step, greedy, to its end (with whatever else the
    engine runs); the most sequences one step ran is kept in ``_serve.widest``."""
    for i, (req, adapter) in enumerate(jobs):
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        eng.add_request(f"r{i}", prompt_token_ids=list(req.prompt), params=params, adapter=adapter)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    running = set(outputs)
    widest = 0
    while running:
        for out in eng.step():
            if out.request_id in outputs:
                outputs[out.request_id].append(out.token_id)
                if out.finished:
                    running.discard(out.request_id)
        widest = max(widest, eng.last_step_stats.num_seqs)
    _serve.widest = widest  # type: ignore[attr-defined]
    return [outputs[f"r{i}"] for i in range(len(jobs))]


def _requests(seed: int, n: int, vocab: int = VOCAB) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req(tuple(rng.randrange(4, vocab) for _ in range(rng.randint(3, 40))), 12) for _ in range(n)
    ]


def _mixed_batch_parity(model_path: Path, adapters: dict[str, Path], vocab: int) -> None:
    reqs = _requests(seed=3, n=4, vocab=vocab)
    names: list[str | None] = [None, "alpha", "beta"]
    jobs = [(r, names[(i + j) % 3]) for i, r in enumerate(reqs) for j in range(3)]
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, adapters=adapters)
    eng = LLMEngine(load(model_path), config)
    outputs = _serve(eng, jobs)
    assert _serve.widest == len(jobs)  # type: ignore[attr-defined]  (one batch held all)
    refs = {None: _reference(model_path, None)}
    refs.update({name: _reference(model_path, path) for name, path in adapters.items()})
    by_name: dict[str | None, dict[Req, list[int]]] = {}
    for (req, name), got in zip(jobs, outputs, strict=True):
        check_parity(refs[name], [req], [got])
        by_name.setdefault(name, {})[req] = got
    # Each adapter changes the tokens: a missing or misplaced delta could not pass.
    for name in ("alpha", "beta"):
        assert any(by_name[name][r] != by_name[None][r] for r in reqs), name
    assert any(by_name["alpha"][r] != by_name["beta"][r] for r in reqs)


def test_rows_of_two_adapters_and_the_base_model_in_one_batch(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    _mixed_batch_parity(tiny_model, adapters, VOCAB)


def test_adapters_of_a_quantized_model(tiny_q4_model: Path, tmp_path: Path) -> None:
    model = load(tiny_q4_model).model
    adapters = {
        "alpha": make_adapter(tmp_path / "alpha", model, seed=1),
        "beta": make_adapter(tmp_path / "beta", model, **BETA),  # type: ignore[arg-type]
    }
    _mixed_batch_parity(tiny_q4_model, adapters, VOCAB)


def test_the_generic_path_mixes_adapters_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    from batchd.engine.models.arch_fixture import VOCAB as ARCH_VOCAB

    path = make_arch_model(tmp_path_factory.mktemp("arch") / "olmo2", "olmo2")
    loaded = load(path)
    assert loaded.spec.generic
    root = tmp_path_factory.mktemp("olmo2-adapters")
    adapters = {
        "alpha": make_adapter(root / "alpha", loaded.model, seed=1),
        "beta": make_adapter(root / "beta", loaded.model, **BETA),  # type: ignore[arg-type]
    }
    _mixed_batch_parity(path, adapters, ARCH_VOCAB)


def test_peft_files_serve_the_same_adapter(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    model = load(tiny_model).model
    peft = make_adapter(tmp_path / "alpha-peft", model, seed=1, peft=True)
    config = EngineConfig(adapters={"mlx": str(adapters["alpha"]), "peft": str(peft)})
    eng = LLMEngine(load(tiny_model), config)
    reqs = _requests(seed=5, n=2)
    got = _serve(eng, [(r, name) for r in reqs for name in ("mlx", "peft")])
    assert got[0] == got[1] and got[2] == got[3]


def test_the_prefix_cache_is_keyed_by_adapter(tiny_model: Path, adapters: dict[str, Path]) -> None:
    eng = LLMEngine(load(tiny_model), EngineConfig(block_size=16, adapters=adapters))
    prompt = list(_requests(seed=9, n=1)[0].prompt) * 3  # at least two full blocks
    assert len(prompt) > 33

    def cached(adapter: str | None) -> tuple[int, list[int]]:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        eng.add_request("q", prompt_token_ids=prompt, params=params, adapter=adapter)
        outs = [o for _ in range(64) if eng.has_unfinished() for o in eng.step()]
        return outs[0].cached_tokens, [o.token_id for o in outs]

    assert cached(None)[0] == 0
    hits, alpha_tokens = cached("alpha")
    assert hits == 0  # the base model's blocks hold other K/V
    assert cached("beta")[0] == 0
    assert cached(None)[0] > 0 and cached("alpha")[0] > 0  # each reuses its own
    check_parity(_reference(tiny_model, adapters["alpha"]), [Req(tuple(prompt), 6)], [alpha_tokens])


def test_lru_eviction_never_drops_an_adapter_in_use(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    config = EngineConfig(max_resident_adapters=1, adapters=adapters)
    eng = LLMEngine(load(tiny_model), config)
    cache = eng.adapters
    assert cache.resident == ["alpha"]  # read at start; the first fills the bound
    req = _requests(seed=11, n=1)[0]
    solo = _serve(eng, [(req, "beta")])
    assert cache.resident == ["beta"]  # alpha evicted: unused
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request("a", prompt_token_ids=list(req.prompt), params=params, adapter="alpha")
    eng.step()
    # alpha is in use: beta's request loads beta next to it, over the bound.
    both = _serve(eng, [(req, "beta")])
    assert cache.resident == ["alpha", "beta"]
    while eng.has_unfinished():
        eng.step()
    assert both == solo  # reloaded weights give the same tokens
    _serve(eng, [(req, None)])
    eng.add_request("c", prompt_token_ids=list(req.prompt), params=params, adapter="alpha")
    assert cache.resident == ["alpha"]  # the least recently used unused one went


def test_an_unknown_adapter_rejects_the_request_alone(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    eng = LLMEngine(load(tiny_model), EngineConfig(adapters=adapters))
    with pytest.raises(
        InvalidRequest, match=r"adapter 'gamma' is not served \(served: alpha, beta"
    ):
        eng.add_request("x", prompt_token_ids=[5, 6, 7], adapter="gamma")
    assert not eng.has_unfinished()
    assert _serve(eng, [(Req((5, 6, 7), 3), "alpha")])[0]


def test_adapters_that_cannot_be_served_fail_at_start(tiny_model: Path, tmp_path: Path) -> None:
    loaded = load(tiny_model)
    dora = make_adapter(tmp_path / "dora", loaded.model, seed=1)
    (dora / "adapter_config.json").write_text('{"fine_tune_type": "dora"}')
    with pytest.raises(AdapterError, match="'d'.*fine_tune_type 'dora'"):
        LLMEngine(loaded, EngineConfig(adapters={"d": str(dora)}))
    with pytest.raises(AdapterError, match="cannot read"):
        LLMEngine(loaded, EngineConfig(adapters={"m": str(tmp_path / "missing")}))
    other = make_arch_model(tmp_path / "olmo2", "olmo2")
    wide = make_adapter(tmp_path / "wide", load(other).model, seed=1)
    with pytest.raises(AdapterError, match="features, the model's layer"):
        LLMEngine(loaded, EngineConfig(adapters={"w": str(wide)}))
    alpha = make_adapter(tmp_path / "alpha", loaded.model, seed=1)
    LLMEngine(loaded, EngineConfig(adapters={"a": str(alpha)}))
    with pytest.raises(AdapterError, match="another engine's adapters"):
        LLMEngine(loaded, EngineConfig(adapters={"a": str(alpha)}))


def test_the_cost_measure_runs(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from measure import lora

    argv = ["--model", str(tiny_model), "--rounds", "1", "--requests", "5", "--max-tokens", "3"]
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "base + 4 adapters: " in out and "x base" in out
