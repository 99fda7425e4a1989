"""Seeded request sets: every system, every run, gets the same requests.

Token ids are drawn uniformly from the model's vocabulary (special ids
excluded): with random weights, throughput depends on lengths only, and
generation ignores EOS and runs to ``max_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Ids below this are the fixture tokenizer's special tokens; real tokenizers
# keep theirs low too. Staying above them keeps prompts plain text.
_FIRST_ORDINARY_ID = 16

# The workloads whose requests all arrive at once: throughput, ratios and MFU.
THROUGHPUT_WORKLOADS = ("mixed", "shared-prefix")
# Workloads run at their own prefill bounds, not the engine settings' one.
LATENCY_WORKLOADS = ("online", "online-sweep")


@dataclass(frozen=True)
class Request:
    """One generation request: prompt ids and how many tokens to generate."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named, seeded list of requests (all arriving at t=0 unless timed elsewhere)."""

    name: str
    requests: list[Request]
    shared_prefix_len: int = 0
    params: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def subset(self, n: int) -> Workload:
        """``n`` requests spread evenly over the list (same length mix, fewer requests)."""
        if n >= len(self.requests):
            return self
        stride = len(self.requests) / n
        picked = [self.requests[int(i * stride)] for i in range(n)]
        return Workload(
            name=self.name,
            requests=picked,
            shared_prefix_len=self.shared_prefix_len,
            params={**self.params, "subset_of": len(self.requests)},
        )


@dataclass(frozen=True)
class Scale:
    """Workload sizes: the full benchmark, --quick, and a tiny one for tests.

    ``num_requests`` is the mixed workload, which every system runs whole
    except the sequential peer (``sequential_requests`` of it). The other
    measurements take ``short_requests``: the shared-prefix workload, the
    online and queue runs (a subset of mixed), and static batching on mixed,
    whose padding and barrier one full wave shows. On a small CPU the peers
    take most of a run's time; these sizes keep ``batchd bench --preset smollm2`` near half an
    hour, since figures that take an afternoon are not measured again.
    """

    name: str
    num_requests: int
    short_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    prefix_len: int
    tail_len: tuple[int, int]
    prefix_output_len: tuple[int, int]
    sequential_requests: int
    warmup_tokens: int
    matmul_size: int


SCALES: dict[str, Scale] = {
    "full": Scale("full", 64, 32, (16, 512), (16, 256), 512, (16, 64), (64, 128), 4, 8, 2048),
    "quick": Scale("quick", 16, 16, (16, 128), (16, 64), 128, (16, 32), (16, 48), 4, 4, 2048),
    "tiny": Scale("tiny", 6, 4, (8, 32), (4, 8), 32, (4, 8), (4, 8), 2, 2, 256),
}


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]


def mixed(*, scale: Scale, vocab_size: int, seed: int = 0) -> Workload:
    """Prompt and output lengths uniform in the scale's ranges; greedy, all at t=0."""
    rng = random.Random(f"mixed-{seed}")
    requests = [
        Request(
            request_id=f"mixed-{i}",
            prompt_ids=_ids(rng, rng.randint(*scale.prompt_len), vocab_size),
            max_tokens=rng.randint(*scale.output_len),
        )
        for i in range(scale.num_requests)
    ]
    return Workload(
        "mixed",
        requests,
        params={"prompt_len": scale.prompt_len, "output_len": scale.output_len, "seed": seed},
    )


def shared_prefix(*, scale: Scale, vocab_size: int, seed: int = 0) -> Workload:
    """One system prefix shared by all requests, then a unique tail each."""
    rng = random.Random(f"shared-prefix-{seed}")
    prefix = _ids(rng, scale.prefix_len, vocab_size)
    requests = [
        Request(
            request_id=f"prefix-{i}",
            prompt_ids=prefix + _ids(rng, rng.randint(*scale.tail_len), vocab_size),
            max_tokens=rng.randint(*scale.prefix_output_len),
        )
        for i in range(scale.short_requests)
    ]
    return Workload(
        "shared-prefix",
        requests,
        shared_prefix_len=scale.prefix_len,
        params={
            "prefix_len": scale.prefix_len,
            "tail_len": scale.tail_len,
            "output_len": scale.prefix_output_len,
            "seed": seed,
        },
    )


def warmup(*, scale: Scale, vocab_size: int, longest_prompt: int) -> Workload:
    """A few short requests that take each system through its first-call costs.

    Drawn from their own seed, so they share no prefix with any workload.
    """
    rng = random.Random("warmup")
    lengths = sorted({8, max(8, longest_prompt // 2), max(8, longest_prompt)})
    requests = [
        Request(f"warmup-{i}", _ids(rng, n, vocab_size), scale.warmup_tokens)
        for i, n in enumerate(lengths)
    ]
    return Workload("warmup", requests)


def poisson_arrivals(*, n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from start) of a Poisson process of ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    rng = random.Random(f"arrivals-{seed}")
    t = 0.0
    times = []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times
