"""Async scheduling (batchd.engine.async_step): step N+1 launched on step N's lazy ids
before the host reads them, with mlx-lm as the oracle of greedy outputs.

Requests finish at different steps (max_tokens, a stop token, an abort), join while
others decode, and the outputs equal the synchronous engine's token for token (seeded
draws included) and mlx-lm's greedy ones; the next step's forward is launched before
the current step's ids are read, each decode step still waits once, and every KV block
is back at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest
from parity_harness import Reference, Req, check_parity, random_requests

from batchd.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.sampling import device

VOCAB = 1024


@pytest.fixture(scope="module")
def llama(tiny_model: Path) -> tuple[LoadedModel, Reference]:
    loaded = load(tiny_model)
    return loaded, Reference(loaded.model)


def _engine(loaded: LoadedModel, *, async_scheduling: bool, **options: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "num_kv_blocks": 192,
        "forward_backend": "mlx",
    }
    config.update(options)
    return LLMEngine(loaded, EngineConfig(async_scheduling=async_scheduling, **config))


def _drive(
    eng: LLMEngine,
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    aborts: dict[int, str] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Add requests and abort them at the given step numbers; every output by request."""
    aborts = aborts or {}
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while step <= max(arrivals) or eng.has_unfinished():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt_token_ids=prompt, params=params)
            outputs[rid] = []
        if step in aborts:
            assert eng.abort(aborts[step])
        for out in eng.step():
            outputs[out.request_id].append(out)
        step += 1
    return outputs


def _tokens(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in outs] for rid, outs in outputs.items()}


def test_greedy_parity_with_mlx_lm_as_requests_stop_abort_and_join(
    llama: tuple[LoadedModel, Reference],
) -> None:
    """Differing max_tokens, a stop token hit mid-run, an abort mid-run and requests
    joining while others decode: mlx-lm's tokens, the synchronous engine's tokens, and
    every block back at the end."""
    loaded, ref = llama
    reqs = random_requests(10, seed=7, vocab=VOCAB, prompt_len=(3, 40), max_tokens=(4, 30))
    # Request 1 stops at the token mlx-lm gives it at output 5 (its first occurrence).
    stop_req = Req(reqs[1].prompt, 40)
    stop_token = ref.run(stop_req)[0][5]
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        if i == 1:
            params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])
        # Six at once, then one every few steps (each joins a batch that is decoding).
        arrivals.setdefault(0 if i < 6 else 3 * (i - 4), []).append(
            (f"p{i}", list(r.prompt), params)
        )
    runs = {}
    for on in (False, True):
        eng = _engine(loaded, async_scheduling=on)
        free = eng.scheduler.block_manager.num_free_blocks
        runs[on] = _tokens(_drive(eng, arrivals, aborts={7: "p2"}))
        bm = eng.scheduler.block_manager
        assert bm.num_free_blocks == free, f"async={on}: blocks left in use"
        bm.check_invariants()
        if on:
            assert eng._async is not None and eng._async.num_overlapped > 10
    assert runs[True] == runs[False]
    got = runs[True]
    want_stop = ref.run(stop_req)[0]
    assert got["p1"] == want_stop[: want_stop.index(stop_token) + 1]
    aborted = ref.run(reqs[2])[0]
    assert 0 < len(got["p2"]) < len(aborted) and got["p2"] == aborted[: len(got["p2"])]
    rest = [i for i in range(len(reqs)) if i not in (1, 2)]
    check_parity(ref, [reqs[i] for i in rest], [got[f"p{i}"] for i in rest])


def test_a_full_batch_pipelines_while_requests_wait(
    llama: tuple[LoadedModel, Reference],
) -> None:
    """With the running cap reached, waiting requests cannot be admitted before a row
    ends: steps still pipeline, each waiting request is admitted a step after a row ends,
    and every request keeps mlx-lm's tokens."""
    loaded, ref = llama
    reqs = random_requests(7, seed=3, vocab=VOCAB, prompt_len=(3, 30), max_tokens=(3, 25))
    arrivals = {
        0: [
            (f"p{i}", list(r.prompt), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
            for i, r in enumerate(reqs)
        ]
    }
    runs = {}
    for on in (False, True):
        eng = _engine(loaded, async_scheduling=on, max_num_seqs=3)
        runs[on] = _tokens(_drive(eng, arrivals))
        if on:
            assert eng._async is not None and eng._async.num_overlapped > 10
        assert eng.scheduler.block_manager.num_free_blocks == eng.scheduler.block_manager.num_blocks
    assert runs[True] == runs[False]
    check_parity(ref, reqs, [runs[True][f"p{i}"] for i in range(len(reqs))])


def _mixed(seed_base: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded rows with every plain control, and rows that cannot pipeline
    (a penalty, a whole-output penalty) finishing early."""
    bias = ((11, 3.0),)
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=seed_base),
        SamplingParams(max_tokens=17, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=8, seed=5),
        SamplingParams(max_tokens=22, ignore_eos=True, logprobs=3, logit_bias=bias),
        SamplingParams(max_tokens=26, temperature=0.7, min_tokens=12, seed=9, min_p=0.05),
        SamplingParams(max_tokens=6, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(
            max_tokens=5, temperature=0.9, repetition_penalty=1.2, seed=6, penalty_window=8
        ),
    ]
    return [(f"r{i}", list(range(30 + i, 50 + 2 * i)), p) for i, p in enumerate(params)]


def test_seeded_and_controlled_rows_draw_the_same_with_async_on_and_off(
    llama: tuple[LoadedModel, Reference],
) -> None:
    """Seeded draws are a function of (seed, output position) only, so the step a row's
    draw is launched in changes nothing: the same tokens, finish reasons and top
    logprobs' tokens; the logprobs to float32 rounding."""
    loaded, _ = llama
    arrivals = {0: _mixed(4), 9: [("late", list(range(70, 90)), _mixed(12)[1][2])]}
    runs = {}
    for on in (False, True):
        eng = _engine(loaded, async_scheduling=on)
        outputs = _drive(eng, arrivals)
        runs[on] = outputs
        if on:
            assert eng._async is not None and eng._async.num_overlapped > 5
    for rid, sync in runs[False].items():
        pipelined = runs[True][rid]
        assert [(o.token_id, o.finish_reason) for o in pipelined] == [
            (o.token_id, o.finish_reason) for o in sync
        ], rid
        for a, b in zip(sync, pipelined, strict=True):
            # A request joins a step later behind one in flight, so rows share other
            # batches: logprobs agree to float32 rounding, not bit for bit.
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), rid
            assert [t for t, _ in a.top_logprobs or []] == [t for t, _ in b.top_logprobs or []]


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every launch and read of a step's draw, and every blocking MLX evaluation, in
    order; draws are numbered by launch (a synchronous step's draw, never launched: -1)."""
    events: list[tuple[str, int]] = []
    launched: list[device.DeviceDraw] = []  # kept alive, so no two share an id()
    real_launch, real_read, real_eval = device.launch, device.read, mx.eval

    def number(draw: device.DeviceDraw) -> int:
        return next((n for n, d in enumerate(launched) if d is draw), -1)

    def launch(draw: device.DeviceDraw, *extra: mx.array) -> None:
        launched.append(draw)
        events.append(("launch", len(launched) - 1))
        real_launch(draw, *extra)

    def read(draw: device.DeviceDraw, *extra: mx.array) -> Any:
        events.append(("read", number(draw)))  # -1: a synchronous step's
        return real_read(draw, *extra)

    def evaluate(*args: Any, **kwargs: Any) -> None:
        events.append(("eval", -1))
        real_eval(*args, **kwargs)

    monkeypatch.setattr(device, "launch", launch)
    monkeypatch.setattr(device, "read", read)
    monkeypatch.setattr(mx, "eval", evaluate)
    yield events


def _counting(events: list[tuple[str, int]]) -> Callable[[], list[str]]:
    start = len(events)

    def kinds() -> list[str]:
        return [kind for kind, _ in events[start:]]

    return kinds


def test_the_next_step_is_launched_before_this_steps_ids_are_read(
    llama: tuple[LoadedModel, Reference], timeline: list[tuple[str, int]]
) -> None:
    """In the steady state a decode step launches step N+1 (its draw evaluated
    asynchronously) and only then reads step N's ids, with one blocking evaluation."""
    loaded, _ = llama
    eng = _engine(loaded, async_scheduling=True)
    for i in range(4):
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.5 * i, seed=i)
        eng.add_request(f"r{i}", prompt_token_ids=list(range(40 + i, 60)), params=params)
    eng.step()  # the prompts: a synchronous step
    pipelined = 0
    while eng.has_unfinished():
        kinds = _counting(timeline)
        step_events = len(timeline)
        eng.step()
        mine = timeline[step_events:]
        reads = [n for kind, n in mine if kind == "read"]
        assert len(reads) == 1, mine
        assert kinds().count("eval") == 1, mine  # the read's wait, nothing else blocks
        if ("launch", reads[0] + 1) in mine:
            # The step after the one read was launched first.
            assert mine.index(("launch", reads[0] + 1)) < mine.index(("read", reads[0]))
            pipelined += 1
    assert pipelined >= 10
    assert eng.scheduler.block_manager.num_free_blocks == eng.scheduler.block_manager.num_blocks


def test_async_scheduling_is_off_where_the_backend_cannot_leave_a_step_in_flight(
    llama: tuple[LoadedModel, Reference], caplog: pytest.LogCaptureFixture
) -> None:
    """The host sampler reads whole logits: async scheduling is logged off, steps run
    synchronously."""
    loaded, _ = llama
    eng = _engine(loaded, async_scheduling=True, sampler="host")
    assert eng._async is None
    assert "async scheduling off" in caplog.text
