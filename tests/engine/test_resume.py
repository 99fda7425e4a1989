"""Resuming a request after a crash is exact: from every cut point, the tokens, the text
of every output and the finish equal those of an uninterrupted run.

The cut points that matter most are the ones where the uninterrupted run was holding
text back: inside a multi-byte character (the tiny model's tokenizer is byte-level BPE,
and sampling often produces partial UTF-8), and right after the beginning of a stop
string, including a stop string spanning the cut and one completed by the last resumed
token (then the request ends at once without generating). Stop strings are taken from
an unstopped run's own text so they surely occur.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.models.loader import LoadedModel, load

MAX_TOKENS = 48
INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class Run:
    """What a caller saw of one request: every output's token and text, and the finish."""

    tokens: list[int]
    texts: list[str]
    finish: str | None

    @property
    def text(self) -> str:
        return "".join(self.texts)


@pytest.fixture(scope="module", params=["auto", "mlx"])
def eng(tiny_model: Path, request: pytest.FixtureRequest) -> LLMEngine:
    """On both forward backends: the C kernels sampling on the host (auto, on an x86
    CPU) and MLX sampling on the device."""
    loaded: LoadedModel = load(tiny_model)
    config = EngineConfig(
        max_num_seqs=64,
        max_num_batched_tokens=512,
        num_kv_blocks=1024,
        forward_backend=request.param,
    )
    return LLMEngine(loaded, config)


def _prompt(i: int) -> list[int]:
    return [(97 * i + 13 * j) % 900 + 50 for j in range(24 + i % 5)]


def _params(i: int, **extra: object) -> SamplingParams:
    sampling: dict[str, object] = {"max_tokens": MAX_TOKENS, "seed": 1000 + i}
    sampling["temperature"] = 0.0 if i % 3 == 0 else 1.0
    sampling.update(extra)
    return SamplingParams(**sampling)  # type: ignore[arg-type]


def _run_all(
    eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams, list[int]]]
) -> dict[str, Run]:
    """Run requests (prompt, params, resumed outputs) together; a request the resumed
    outputs already end has no outputs and that finish."""
    runs = {rid: Run([], [], None) for rid in requests}
    for rid, (prompt, params, resumed) in requests.items():
        finish = eng.add_request(
            rid, prompt_token_ids=prompt, params=params, resume_output_token_ids=resumed
        )
        if finish is not None:
            runs[rid] = Run([], [], finish)
    while eng.has_unfinished():
        for out in eng.step():
            run = runs[out.request_id]
            assert out.index == len(requests[out.request_id][2]) + len(run.tokens)
            run.tokens.append(out.token_id)
            run.texts.append(out.text)
            if out.finished:
                runs[out.request_id] = Run(run.tokens, run.texts, out.finish_reason)
    return runs


def _expected_text(eng: LLMEngine, run: Run, params: SamplingParams) -> str:
    """``decode(tokens)`` without an end token (and special tokens, skipped by default),
    cut before the first stop string."""
    tokens = run.tokens
    if run.finish == "stop" and tokens[-1] in (set(params.stop_token_ids) | eng.eos_token_ids):
        tokens = tokens[:-1]
    text: str = eng.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
    cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


@dataclass(frozen=True)
class Held:
    """Cut points where the uninterrupted run held text back."""

    partial_char: list[int]
    stop_prefix: list[int]
    inside_stop: list[int]


def _check_every_cut(
    eng: LLMEngine, cases: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Held]:
    """Resume every case from every cut point 1..n (n: a stopped run's last token, whose
    resume ends at once) and compare with its uninterrupted run; the held text seen."""
    full = _run_all(eng, {name: (prompt, params, []) for name, (prompt, params) in cases.items()})
    resumes: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
    for name, (prompt, params) in cases.items():
        run = full[name]
        assert run.finish in ("stop", "length"), name
        assert run.text == _expected_text(eng, run, params), name
        for cut in range(1, len(run.tokens) + 1):
            resumes[f"{name}@{cut}"] = (prompt, params, run.tokens[:cut])
    resumed = _run_all(eng, resumes)
    held: dict[str, Held] = {}
    for name, (_, params) in cases.items():
        run = full[name]
        seen = Held([], [], [])
        stop_at = len(run.text) if run.finish == "stop" else None
        for cut in range(1, len(run.tokens) + 1):
            after = resumed[f"{name}@{cut}"]
            where = f"{name} resumed after {cut} of {len(run.tokens)} tokens"
            assert after.tokens == run.tokens[cut:], where
            assert after.texts == run.texts[cut:], where
            assert after.finish == run.finish, where
            delivered = "".join(run.texts[:cut])
            assert delivered + after.text == run.text, where
            decoded: str = eng.tokenizer.decode(
                run.tokens[:cut], skip_special_tokens=params.skip_special_tokens
            )
            if cut < len(run.tokens) and len(decoded) > len(delivered):
                if decoded.endswith(INCOMPLETE):
                    seen.partial_char.append(cut)
                elif any(decoded.endswith(s[:k]) for s in params.stop for k in range(1, len(s))):
                    seen.stop_prefix.append(cut)
                if stop_at is not None and len(decoded) > stop_at and params.stop:
                    seen.inside_stop.append(cut)
        held[name] = seen
    return held


def _unstopped(eng: LLMEngine, n: int) -> dict[int, Run]:
    runs = _run_all(eng, {str(i): (_prompt(i), _params(i), []) for i in range(n)})
    return {int(rid): run for rid, run in runs.items()}


def _stop_spanning_tokens(eng: LLMEngine, run: Run, *, length: int, multibyte: bool) -> str | None:
    """A substring of the run's text of ``length`` characters that starts in one token and
    ends in a later one (with a non-ASCII character when ``multibyte``), if there is one."""
    bounds, pos = [], 0
    for text in run.texts:
        pos += len(text)
        bounds.append(pos)
    text = run.text
    for start in range(len(text) // 3, len(text) - length):
        stop = text[start : start + length]
        if INCOMPLETE in stop or stop.strip() != stop:
            continue
        if multibyte and all(ord(c) < 128 for c in stop):
            continue
        if any(start < b < start + length for b in bounds):
            return stop
    return None


def test_resume_from_every_cut_matches_an_uninterrupted_run(eng: LLMEngine) -> None:
    runs = _unstopped(eng, 48)  # a few of them sample a whole multi-byte character
    cases: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, run in runs.items():
        kind = "greedy" if i % 3 == 0 else "seeded"
        stop = _stop_spanning_tokens(eng, run, length=4, multibyte=False)
        if stop is not None and f"{kind}-stop" not in cases:
            # A decoy sharing the stop string's start: held back, never completed.
            stops = [stop, stop[:2] + "\x00\x01"]
            cases[f"{kind}-stop"] = (_prompt(i), _params(i, stop=stops))
        wide = _stop_spanning_tokens(eng, run, length=3, multibyte=True)
        if wide is not None and "multibyte-stop" not in cases:
            cases["multibyte-stop"] = (_prompt(i), _params(i, stop=[wide]))
        partial = [k for k in range(1, len(run.tokens)) if run.texts[k - 1] == ""]
        if partial and f"{kind}-end-token" not in cases:
            # An end token right after held text: the final output flushes it.
            end = run.tokens[partial[len(partial) // 2]]
            cases[f"{kind}-end-token"] = (_prompt(i), _params(i, stop_token_ids=[end]))
        cases.setdefault(f"{kind}-length", (_prompt(i), _params(i)))
    assert set(cases) >= {"greedy-stop", "seeded-stop", "multibyte-stop", "seeded-end-token"}
    held = _check_every_cut(eng, cases)
    assert held["multibyte-stop"].partial_char and held["seeded-length"].partial_char, held
    assert held["seeded-stop"].stop_prefix and held["greedy-stop"].stop_prefix, held
    assert held["multibyte-stop"].inside_stop and held["seeded-stop"].inside_stop, held


def test_resumed_outputs_that_end_the_request_queue_nothing(eng: LLMEngine) -> None:
    prompt, params = _prompt(1), _params(1, max_tokens=6)
    run = _run_all(eng, {"r": (prompt, params, [])})["r"]
    assert run.finish == "length" and len(run.tokens) == 6
    for resumed, finish in [(run.tokens, "length"), (run.tokens + [5], "length")]:
        got = eng.add_request(
            "again", prompt_token_ids=prompt, params=params, resume_output_token_ids=resumed
        )
        assert got == finish
        assert not eng.has_unfinished()
    eos = sorted(eng.eos_token_ids)[0]
    got = eng.add_request(
        "eos", prompt_token_ids=prompt, params=params, resume_output_token_ids=[7, eos]
    )
    assert got == "stop" and not eng.has_unfinished()


def test_resume_counts_the_context_length(tiny_model: Path) -> None:
    eng = LLMEngine(load(tiny_model), EngineConfig(max_model_len=40, num_kv_blocks=64))
    prompt, params = _prompt(2), _params(2, max_tokens=100)
    run = _run_all(eng, {"r": (prompt, params, [])})["r"]
    assert run.finish == "length" and len(prompt) + len(run.tokens) == 40
    resumed = _run_all(eng, {"r": (prompt, params, run.tokens[:5])})["r"]
    assert resumed.tokens == run.tokens[5:] and resumed.finish == "length"
    got = eng.add_request(
        "all", prompt_token_ids=prompt, params=params, resume_output_token_ids=run.tokens
    )
    assert got == "length"
