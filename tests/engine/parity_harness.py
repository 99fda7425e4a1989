"""Greedy parity against mlx-lm: each request alone through generate_step is the oracle.

Float rounding differs between a packed batch and a lone request (other
matrix shapes, other kernels), so a greedy token can only legitimately differ
where the reference itself is at a near-tie. `check_parity` therefore accepts
a divergence only if, at its first differing position, the engine's token is
within NEAR_TIE of the reference's in the reference's own log-probabilities;
anything else fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from batchd.engine import LLMEngine, RequestOutput, SamplingParams
from batchd.producers.client import Client

NEAR_TIE = 1e-4


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Divergence:
    request: int
    position: int
    margin: float


@dataclass
class ParityReport:
    requests: int = 0
    tokens: int = 0
    divergences: list[Divergence] = field(default_factory=list)


def random_requests(
    n: int,
    *,
    seed: int,
    vocab: int,
    prompt_len: tuple[int, int] = (1, 300),
    max_tokens: tuple[int, int] = (1, 64),
) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req(
            tuple(rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))),
            rng.randint(*max_tokens),
        )
        for _ in range(n)
    ]


def shared_prefix_requests(n: int, *, seed: int, vocab: int, prefixes: int = 3) -> list[Req]:
    """Requests whose prompts start with one of a few long shared prefixes."""
    rng = random.Random(seed)
    heads = [
        [rng.randrange(4, vocab) for _ in range(rng.randint(40, 200))] for _ in range(prefixes)
    ]
    return [
        Req(
            tuple(
                heads[i % prefixes] + [rng.randrange(4, vocab) for _ in range(rng.randint(1, 40))]
            ),
            rng.randint(1, 48),
        )
        for i in range(n)
    ]


class Reference:
    """mlx-lm's tokens (and log-probabilities) for one request alone, cached per prompt."""

    def __init__(self, model: object) -> None:
        self.model = model
        self._runs: dict[tuple[int, ...], tuple[list[int], list[mx.array]]] = {}

    def run(self, req: Req) -> tuple[list[int], list[mx.array]]:
        cached = self._runs.get(req.prompt)
        if cached is None or len(cached[0]) < req.max_tokens:
            tokens, logprobs = [], []
            steps = generate_step(mx.array(req.prompt), self.model, max_tokens=req.max_tokens)
            for token, lp in steps:
                tokens.append(int(token))
                logprobs.append(lp)
            cached = (tokens, logprobs)
            self._runs[req.prompt] = cached
        return cached[0][: req.max_tokens], cached[1][: req.max_tokens]


def run_engine(eng: LLMEngine, reqs: list[Req], *, waves: int = 1, gap: int = 4) -> list[list[int]]:
    """Submit `reqs` in `waves` groups, `gap` steps apart; greedy, ignore EOS."""
    per_wave = -(-len(reqs) // waves)
    pending = [(i, r) for i, r in enumerate(reqs)]
    outputs: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % gap == 0:
            for i, r in pending[:per_wave]:
                params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
                eng.add_request(f"p{i}", prompt_token_ids=list(r.prompt), params=params)
            pending = pending[per_wave:]
        for out in eng.step():
            outputs[int(out.request_id[1:])].append(out.token_id)
        step += 1
    return [outputs[i] for i in range(len(reqs))]


@dataclass
class StepWatch:
    """Counts, over every step of an engine, the prefill chunks that continue a prompt
    (chunked prefill), and runs ``after_step`` (e.g. invariant checks) after each."""

    chunked: int = 0


def watch_steps(eng: LLMEngine, after_step: Callable[[], None] | None = None) -> StepWatch:
    """Wrap ``eng.step`` so the returned StepWatch counts its continued prefill chunks."""
    watch = StepWatch()
    original_step = eng.step

    def watched_step() -> list[RequestOutput]:
        result = original_step()
        watch.chunked += sum(
            1
            for c in eng.last_step_stats.chunks
            if c.kind == "prefill" and c.start > 0 and c.num_tokens > 1
        )
        if after_step is not None:
            after_step()
        return result

    eng.step = watched_step  # type: ignore[method-assign]
    return watch


def check_parity(ref: Reference, reqs: list[Req], outputs: list[list[int]]) -> ParityReport:
    """Assert every request equals the reference up to a proven near-tie."""
    report = ParityReport(requests=len(reqs))
    for i, (req, got) in enumerate(zip(reqs, outputs, strict=True)):
        want, logprobs = ref.run(req)
        report.tokens += len(want)
        assert len(got) == len(want), f"request {i}: {len(got)} tokens, expected {len(want)}"
        diff = next((p for p, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        if diff is None:
            continue
        lp = logprobs[diff]
        margin = float(lp[want[diff]] - lp[got[diff]])
        assert margin < NEAR_TIE, (
            f"request {i} (prompt {len(req.prompt)} tokens) diverges at output {diff}: "
            f"reference {want[diff]}, engine {got[diff]}, reference margin {margin:.3g} "
            f"(not a near-tie)\nwant {want}\ngot  {got}"
        )
        report.divergences.append(Divergence(i, diff, margin))
    return report


def prompt_logprobs_reference(model: object, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob given the ones before it, from mlx-lm's forward of the
    whole prompt (float32 log-softmax): the oracle of prompt_logprobs."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)  # type: ignore[operator]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs[:-1], mx.array(prompt[1:])[:, None], axis=-1)
    return [float(x) for x in picked[:, 0].tolist()]  # type: ignore[union-attr]


def served_greedy(daemon: Any, redis_url: str, reqs: list[Req]) -> list[Any]:
    """Each request's greedy result from a ``batchd serve`` daemon (a DaemonProcess)
    through Redis, submitted all at once (so they batch); the daemon is killed after."""
    try:
        daemon.wait_serving(timeout=300)
        with Client(redis_url) as client:
            jobs = [
                client.submit(
                    prompt_token_ids=list(r.prompt),
                    max_tokens=r.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                )
                for r in reqs
            ]
            return [job.result(timeout=300) for job in jobs]
    finally:
        daemon.kill()
