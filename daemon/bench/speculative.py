"""The ``speculative`` workload: batchd with speculative decoding off and on, same run.

Two request sets, each run by one engine with ``speculative="off"`` and one with the
chosen method: ``"ngram"`` (n-gram prompt lookup, the default) or ``"draft"`` (a draft
model of the same tokenizer proposes, ``--draft-model``), in alternating rounds (off,
on, on, off, ...) so a slow spell of the host falls on both; the figure is the median
round's tokens/s:

- ``extraction``: real text: a passage, and an instruction to repeat it, copy it with a
  small change, or quote part of it (the outputs a job queue sees from extraction
  and editing jobs, which contain much of their prompt), through the model's chat
  template, greedy, ending at the model's end token or max_tokens. Meaningful on a
  real model (``--preset smollm2``); on random weights nothing is copied.
- ``mixed``: the mixed workload's requests (random tokens, ignore_eos): what
  speculation costs where proposals rarely hold.

Both check that the outputs with speculation equal those without, token for token,
and report the acceptance rate (accepted / proposed tokens) and the speed-up.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from batchd.daemon.bench.engine_system import bench_engine_config
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.workloads import Scale, mixed
from batchd.engine import EngineConfig, LLMEngine, SamplingParams

# Public-domain passages (Carroll, Austen, Melville, Dickens, Twain, Doyle, Wells, Shelley).
PASSAGES = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it, and what is the use of a "
    "book, thought Alice, without pictures or conversations?",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of "
    "such a man may be on his first entering a neighbourhood, this truth is so well fixed "
    "in the minds of the surrounding families, that he is considered the rightful "
    "property of some one or other of their daughters.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would "
    "sail about a little and see the watery part of the world.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it "
    "was the age of foolishness, it was the epoch of belief, it was the epoch of "
    "incredulity, it was the season of Light, it was the season of Darkness.",
    "Tom appeared on the sidewalk with a bucket of whitewash and a long-handled brush. He "
    "surveyed the fence, and all gladness left him and a deep melancholy settled down "
    "upon his spirit. Thirty yards of board fence nine feet high.",
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under "
    "any other name. In his eyes she eclipses and predominates the whole of her sex. It "
    "was not that he felt any emotion akin to love for Irene Adler.",
    "No one would have believed in the last years of the nineteenth century that this "
    "world was being watched keenly and closely by intelligences greater than man's and "
    "yet as mortal as his own.",
    "You will rejoice to hear that no disaster has accompanied the commencement of an "
    "enterprise which you have regarded with such evil forebodings. I arrived here "
    "yesterday, and my first task is to assure my dear sister of my welfare.",
)

TASKS = (
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Here is a passage:\n\n{passage}\n\nRewrite the passage above exactly as it is.",
    "Copy the following passage, replacing every comma with a semicolon:\n\n{passage}",
    "Quote the first two sentences of this text verbatim:\n\n{passage}",
)

EXTRACTION_MAX_TOKENS = 160
METHODS = ("ngram", "draft")
METHOD_TITLES = {"ngram": "n-gram prompt lookup", "draft": "draft model"}


@dataclasses.dataclass(frozen=True)
class SpecRequest:
    request_id: str
    params: SamplingParams
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


def extraction_requests(max_tokens: int = EXTRACTION_MAX_TOKENS) -> list[SpecRequest]:
    """Every task on every passage, as chat messages; greedy."""
    return [
        SpecRequest(
            f"extract-{p}-{t}",
            SamplingParams(max_tokens=max_tokens),
            messages=[{"role": "user", "content": task.format(passage=passage)}],
        )
        for p, passage in enumerate(PASSAGES)
        for t, task in enumerate(TASKS)
    ]


def mixed_requests(scale: Scale, vocab_size: int, seed: int) -> list[SpecRequest]:
    """The mixed workload's short subset (random tokens, ignore_eos): greedy."""
    workload = mixed(scale=scale, vocab_size=vocab_size, seed=seed).subset(scale.short_requests)
    return [
        SpecRequest(
            r.request_id,
            SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
            prompt_ids=r.prompt_ids,
        )
        for r in workload.requests
    ]


def _run_once(engine: LLMEngine, requests: list[SpecRequest]) -> tuple[float, dict[str, list[int]]]:
    """All requests at once, to the end; (seconds, tokens by request)."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    start = time.perf_counter()
    for r in requests:
        engine.add_request(
            r.request_id, prompt_token_ids=r.prompt_ids, messages=r.messages, params=r.params
        )
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
    return time.perf_counter() - start, tokens


def compare(
    engines: dict[str, LLMEngine], requests: list[SpecRequest], *, rounds: int
) -> dict[str, Any]:
    """Run ``requests`` on each engine ``rounds`` times, alternating the order; the
    median round of each, the acceptance rate and whether outputs matched."""
    seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs: dict[str, dict[str, list[int]]] = {}
    counts = {mode: (e.num_draft_tokens, e.num_accepted_tokens) for mode, e in engines.items()}
    order = list(engines)
    for i in range(rounds):
        for mode in order if i % 2 == 0 else reversed(order):
            took, tokens = _run_once(engines[mode], requests)
            seconds[mode].append(took)
            outputs.setdefault(mode, tokens)
    method = next(mode for mode in engines if mode != "off")
    total = sum(len(t) for t in outputs["off"].values())
    result: dict[str, Any] = {
        "requests": len(requests),
        "output_tokens": total,
        "rounds": rounds,
        "identical": all(outputs[m] == outputs["off"] for m in outputs),
        "systems": {},
    }
    for mode, engine in engines.items():
        drafted = engine.num_draft_tokens - counts[mode][0]
        accepted = engine.num_accepted_tokens - counts[mode][1]
        median = statistics.median(seconds[mode])
        result["systems"][mode] = {
            "seconds": [round(s, 3) for s in seconds[mode]],
            "median_s": round(median, 3),
            "tok_s": round(total / median, 2),
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        }
    systems = result["systems"]
    result["speedup"] = round(systems[method]["tok_s"] / systems["off"]["tok_s"], 3)
    return result


def run_speculative(
    *,
    model_path: Path,
    engine: EngineConfig,
    scale: Scale,
    vocab_size: int,
    seed: int,
    progress: Progress,
    rounds: int = 3,
    method: str = "ngram",
    draft_model: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """The extraction and mixed request sets, speculation off and with ``method`` (see
    the module); ``draft_model`` (directory, hub id or preset name) for ``"draft"``;
    ``limit``: at most that many requests of each set (tests)."""
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} unknown; choose from {METHODS}")
    if method == "draft" and not draft_model:
        raise ValueError('the speculative method "draft" needs a draft model')
    sets = {
        "extraction": extraction_requests()[:limit],
        "mixed": mixed_requests(scale, vocab_size, seed)[:limit],
    }
    longest = max(scale.prompt_len[1] + scale.output_len[1], 512 + EXTRACTION_MAX_TOKENS)
    base = bench_engine_config(
        engine,
        longest_request=longest,
        max_prefill_tokens_with_decodes=engine.max_prefill_tokens_with_decodes,
    )
    configs = {
        "off": dataclasses.replace(base, speculative="off"),
        method: dataclasses.replace(
            base,
            speculative=method,
            speculative_draft_model=draft_model if method == "draft" else None,
        ),
    }
    engines = {
        mode: LLMEngine.from_pretrained(str(model_path), config) for mode, config in configs.items()
    }
    # First-call costs (the C kernels' threads, the chat template) out of the figures.
    for e in engines.values():
        _run_once(e, extraction_requests(8)[:4])
    result: dict[str, Any] = {
        "method": method,
        "num_speculative_tokens": base.num_speculative_tokens,
    }
    if method == "ngram":
        result["ngram"] = [base.speculative_ngram_min, base.speculative_ngram_max]
    else:
        result["draft_model"] = draft_model
    for name, requests in sets.items():
        progress.phase(f"speculative: {name}, off and {method}, {rounds} rounds")
        result[name] = compare(engines, requests, rounds=rounds)
        r = result[name]
        progress.say(
            f"{name}: {r['speedup']:.2f}x with {method}, acceptance "
            f"{r['systems'][method]['acceptance_rate']}, identical {r['identical']}"
        )
    return result


def _method(result: dict[str, Any]) -> str:
    """The method a report compared with off (reports before the draft method: ngram)."""
    return str(result.get("method", "ngram"))


def speculative_headline(result: dict[str, Any]) -> str:
    method = _method(result)
    parts = []
    for name in ("extraction", "mixed"):
        r = result.get(name)
        if r is None:
            continue
        rate = r["systems"][method]["acceptance_rate"]
        parts.append(
            f"speculative {name} {r['speedup']:.2f}x with {method} (acceptance "
            f"{'n/a' if rate is None else f'{rate:.0%}'})"
        )
    return ", ".join(parts)


def speculative_lines(result: dict[str, Any]) -> list[str]:
    """The report's markdown section."""
    method = _method(result)
    if method == "ngram":
        low, high = result["ngram"]
        setting = f"n-grams {low}..{high}"
    else:
        setting = f"draft model {result['draft_model']}"
    lines = [
        f"## Speculative decoding ({METHOD_TITLES.get(method, method)})",
        "",
        f"num_speculative_tokens {result['num_speculative_tokens']}, {setting}; "
        "median of the rounds.",
        "",
        f"| requests | tokens | off tok/s | {method} tok/s | speed-up | acceptance | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("extraction", "mixed"):
        r = result.get(name)
        if r is None:
            continue
        off, on = r["systems"]["off"], r["systems"][method]
        rate = on["acceptance_rate"]
        lines.append(
            f"| {name} ({r['requests']}) | {r['output_tokens']} | {off['tok_s']:.1f} | "
            f"{on['tok_s']:.1f} | {r['speedup']:.2f}x | "
            f"{'n/a' if rate is None else f'{rate:.0%}'} | {r['identical']} |"
        )
    return lines
