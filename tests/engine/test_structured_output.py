"""Structured output on the tiny random-weight model: garbage unless constrained, so every
output that validates is the grammar's doing.

100 seeded requests constrained to a nested JSON schema all validate with ``jsonschema``,
alone and mixed with unconstrained requests (whose tokens are those of a run without
constrained neighbours); greedy and seeded constrained runs are deterministic; a
constrained request resumed after a crash continues exactly as an uninterrupted run;
regex, Lark, GBNF and any-JSON-object constraints hold; bad grammars are refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import jsonschema
import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.models.loader import load
from batchd.engine.scheduling.sequence import FinishReason
from support.schemas import LENIENT_ONLY, NESTED_SCHEMA, nested_constraint

MAX_TOKENS = 256  # the nested schema's JSON takes ~90 tokens at most here


@pytest.fixture(scope="module")
def eng(tiny_model: Path) -> LLMEngine:
    return LLMEngine(load(tiny_model), EngineConfig(max_num_seqs=64, num_kv_blocks=2048))


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 900 + 50 for j in range(8 + i % 13)]


def _constrained(i: int, **extra: object) -> SamplingParams:
    sampling: dict[str, object] = {
        "max_tokens": MAX_TOKENS,
        "seed": i,
        "temperature": 0.0 if i % 4 == 0 else 1.0,
        "constraint": nested_constraint(),
    }
    sampling.update(extra)
    return SamplingParams(**sampling)  # type: ignore[arg-type]


def _run(
    eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str, str | None]]:
    """Run requests together: per request its tokens, text and finish reason."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt_token_ids=prompt, params=params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    texts = dict.fromkeys(requests, "")
    finish: dict[str, str | None] = dict.fromkeys(requests)
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id].append(out.token_id)
            texts[out.request_id] += out.text
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason.value
    return {rid: (tokens[rid], texts[rid], finish[rid]) for rid in requests}


def _assert_valid(results: dict[str, tuple[list[int], str, str | None]]) -> None:
    for rid, (_, text, finish) in results.items():
        assert finish == "stop", f"{rid} ended {finish}: {text!r}"
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)


def test_100_seeded_requests_validate_alone_and_mixed(eng: LLMEngine) -> None:
    alone = _run(eng, {f"c{i}": (_prompt(i), _constrained(i)) for i in range(100)})
    _assert_valid(alone)
    assert len({text for _, text, _ in alone.values()}) > 50  # seeds give different outputs

    free = {
        f"u{i}": (
            _prompt(1000 + i),
            SamplingParams(max_tokens=24, seed=i, temperature=0.0 if i % 2 else 0.8),
        )
        for i in range(30)
    }
    free_alone = _run(eng, free)
    mixed = _run(eng, {**free, **{f"c{i}": (_prompt(i), _constrained(i)) for i in range(100)}})
    _assert_valid({rid: r for rid, r in mixed.items() if rid.startswith("c")})
    # Deterministic under constraints, whatever the batch; unconstrained rows untouched.
    assert all(mixed[rid][0] == alone[rid][0] for rid in alone)
    assert all(mixed[rid][0] == free_alone[rid][0] for rid in free)


def test_resume_replays_the_grammar_and_continues_exactly(eng: LLMEngine) -> None:
    requests = {f"r{i}": (_prompt(i), _constrained(i)) for i in range(6)}
    full = _run(eng, requests)
    for rid, (tokens, _, _) in full.items():
        for cut in (1, len(tokens) // 3, len(tokens) - 2):
            prompt, params = requests[rid]
            eng.add_request(
                rid, prompt_token_ids=prompt, params=params, resume_output_token_ids=tokens[:cut]
            )
            rest: list[int] = []
            while eng.has_unfinished():
                rest.extend(out.token_id for out in eng.step())
            assert tokens[:cut] + rest == tokens, (rid, cut)


def test_a_resumed_token_the_grammar_refuses_is_bad_input(eng: LLMEngine) -> None:
    bad = eng.tokenizer.encode("x")  # a JSON object cannot start with "x"
    with pytest.raises(ValueError, match="not allowed"):
        eng.add_request(
            "bad", prompt_token_ids=_prompt(1), params=_constrained(1), resume_output_token_ids=bad
        )
    assert not eng.has_unfinished()


def test_a_grammar_that_fails_mid_way_ends_its_request_alone(eng: LLMEngine) -> None:
    eng.add_request("doomed", prompt_token_ids=_prompt(2), params=_constrained(2))
    eng.add_request("fine", prompt_token_ids=_prompt(3), params=_constrained(3))
    # As if llguidance hit a limit at token 5 (the request's one sample's matcher).
    matcher = eng._states[eng._live["doomed"][0].seq_id].matcher
    assert matcher is not None
    consume, seen = matcher.consume, []

    def failing(token_id: int) -> None:
        seen.append(token_id)
        if len(seen) == 5:
            raise InvalidRequest("step lexer fuel exhausted")
        consume(token_id)

    matcher.consume = failing  # type: ignore[method-assign]
    ends = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    assert ends["doomed"] == (FinishReason.error, "request 'doomed': step lexer fuel exhausted")
    assert ends["fine"] == (FinishReason.stop, None)


@pytest.mark.parametrize(
    ("constraint", "check", "min_stopped"),
    [
        (
            Constraint("regex", r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"),
            lambda t: re.fullmatch(r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", t),
            8,
        ),
        (
            Constraint("lark", 'start: "yes" | "no" | "maybe"'),
            lambda t: t in ("yes", "no", "maybe"),
            8,
        ),
        (
            Constraint("gbnf", 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
            lambda t: re.fullmatch(r"\(\d+(\+\d+)?\)", t),
            6,
        ),
        # Any object may go on for ever: some of a random model's hit max_tokens.
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict), 2),
    ],
)
def test_regex_lark_gbnf_and_json_object(
    eng: LLMEngine, constraint: Constraint, check: object, min_stopped: int
) -> None:
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, seed=i, temperature=1.0, constraint=constraint)
        for i in range(8)
    ]
    results = _run(eng, {f"g{i}": (_prompt(i), p) for i, p in enumerate(params)})
    for _, text, finish in results.values():
        if finish == "stop":
            assert check(text), text  # type: ignore[operator]
    assert sum(f == "stop" for _, _, f in results.values()) >= min_stopped


@pytest.mark.parametrize(
    ("kind", "source", "problem"),
    [
        ("json_schema", '{"type": "strnig"}', "strnig"),
        ("json_schema", "{not json", "not JSON"),
        ("regex", "a(b", "unclosed group"),
        ("gbnf", 'root ::= "a" missing', "missing"),
        ("xml", "", "kind must be one of"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_problem(
    kind: str, source: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        Constraint(kind, source)


@pytest.mark.parametrize("keyword", sorted(LENIENT_ONLY))
def test_lenient_is_an_opt_in(eng: LLMEngine, keyword: str) -> None:
    """llguidance's lenient mode: refused by default, naming the keyword and the option;
    accepted with lenient, and the output still holds to the rest of the schema."""
    source = json.dumps(LENIENT_ONLY[keyword])
    with pytest.raises(InvalidRequest, match=f"{keyword}.*set lenient"):
        Constraint("json_schema", source)
    constraint = Constraint("json_schema", source, lenient=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=1, temperature=1.0, constraint=constraint)
    ((_, text, finish),) = _run(eng, {"l": (_prompt(1), params)}).values()
    if finish == "stop":
        json.loads(text)
    with pytest.raises(InvalidRequest, match="lenient applies to json_schema"):
        Constraint("regex", "a+", lenient=True)


def test_min_tokens_holds_the_end_back(eng: LLMEngine) -> None:
    eos = min(eng.eos_token_ids)
    bias = ((eos, 100.0),)  # without min_tokens the first token would be the end
    results = _run(
        eng,
        {
            "early": (_prompt(3), SamplingParams(max_tokens=20, logit_bias=bias)),
            "held": (_prompt(3), SamplingParams(max_tokens=20, logit_bias=bias, min_tokens=5)),
        },
    )
    assert results["early"][0] == [eos]
    assert len(results["held"][0]) == 6 and results["held"][0][-1] == eos


@pytest.mark.slow
def test_100_seeded_requests_validate_on_a_real_model() -> None:
    """BATCHD_REAL_MODEL=<model dir> (e.g. SmolLM2-135M-Instruct): chat prompts asking for
    the JSON, greedy and seeded, alone and mixed with unconstrained requests."""
    path = os.environ.get("BATCHD_REAL_MODEL")
    if not path:
        pytest.skip("set BATCHD_REAL_MODEL to a model directory")
    real = LLMEngine(load(Path(path)), EngineConfig(max_num_seqs=32))
    ask = "Describe a person as JSON with name, age, role, scores and address."
    for i in range(100):
        real.add_request(
            f"c{i}",
            messages=[{"role": "user", "content": f"{ask} Person number {i}."}],
            params=_constrained(i),
        )
        if i % 4 == 0:
            real.add_request(
                f"u{i}", prompt=f"Once upon a time {i}", params=SamplingParams(max_tokens=32)
            )
    texts: dict[str, str] = {}
    finish: dict[str, str | None] = {}
    while real.has_unfinished():
        for out in real.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            finish[out.request_id] = out.finish_reason and out.finish_reason.value
    _assert_valid({rid: ([], texts[rid], finish[rid]) for rid in texts if rid.startswith("c")})
