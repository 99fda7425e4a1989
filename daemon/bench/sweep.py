"""The online sweep: the same Poisson arrivals run by batchd at several prefill bounds.

``engine.max_prefill_tokens_with_decodes`` trades the two online targets against
each other: a small bound keeps the steps that carry prefill short (even
inter-token latency) but makes prompts that arrive together wait for each
other's chunks (time to first token). The sweep shows the trade-off on this
machine, next to what no bound at all can remove: the spread of decode-only
steps (batch sizes that change as requests come and go, and the machine's own
jitter). Settings run in rounds, in reverse order every other round, with
BatchGenerator once a round, so that a drift of the machine's speed shows as a
difference between rounds rather than between settings.
"""

from __future__ import annotations

from typing import Any

from batchd.daemon.bench.systems import BATCHD, BATCHGEN, Systems, SystemUnavailable
from batchd.daemon.bench.workloads import Workload, poisson_arrivals

# The bounds swept by default: none is the throughput setting, 64 the online workload's.
DEFAULT_BOUNDS: tuple[int | None, ...] = (16, 32, 64, None)
DEFAULT_ROUNDS = 2


def setting_name(bound: int | None) -> str:
    return "no bound" if bound is None else f"bound {bound}"


def run_online_sweep(
    systems: Systems,
    workload: Workload,
    *,
    rate: float,
    seed: int,
    bounds: tuple[int | None, ...] = DEFAULT_BOUNDS,
    rounds: int = DEFAULT_ROUNDS,
) -> dict[str, Any]:
    """Each round: BatchGenerator, then batchd at every bound; figures per setting per round."""
    if not bounds or rounds < 1:
        raise ValueError(f"a sweep needs bounds and rounds >= 1, got {bounds}, {rounds}")
    arrivals = poisson_arrivals(n=len(workload.requests), rate=rate, seed=seed)
    result: dict[str, Any] = {
        "requests": len(workload.requests),
        "rate_req_s": round(rate, 4),
        "bounds": list(bounds),
        "rounds": [],
        "unavailable": {},
    }
    for number in range(rounds):
        figures: dict[str, Any] = {}
        try:
            stats = systems.timed(BATCHGEN, workload, arrivals, prefill_bound=None)
            figures[BATCHGEN] = _figures(stats.summary())
        except SystemUnavailable as exc:
            result["unavailable"][BATCHGEN] = str(exc)
        order = bounds if number % 2 == 0 else tuple(reversed(bounds))
        for bound in order:
            try:
                stats = systems.timed(BATCHD, workload, arrivals, prefill_bound=bound)
            except SystemUnavailable as exc:
                result["unavailable"][BATCHD] = str(exc)
                break
            figures[setting_name(bound)] = _figures(stats.summary())
        result["rounds"].append(figures)
    return result


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What the sweep table shows of one run."""
    p50, p99 = summary["itl_p50_s"], summary["itl_p99_s"]
    figures = {
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "itl_p50_s": p50,
        "itl_p99_s": p99,
        "itl_spread": round(p99 / p50, 3) if p50 else None,
    }
    steps = summary.get("engine_steps")
    if steps and steps["decode_only_p50_s"]:
        figures["decode_only_spread"] = round(
            steps["decode_only_p99_s"] / steps["decode_only_p50_s"], 3
        )
        figures["gap_share_with_prefill"] = steps["gap_share_with_prefill"]
    return figures


def _settings(sweep: dict[str, Any]) -> list[str]:
    """The keys of a round's figures: batchd's bounds in sweep order, then BatchGenerator."""
    return [setting_name(b) for b in sweep["bounds"]] + [BATCHGEN]


def sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """The sweep as a Markdown table: a row per setting, a column per round."""
    rounds = sweep["rounds"]
    header = " | ".join(f"round {i + 1}" for i in range(len(rounds)))
    lines = [
        "",
        f"Online sweep: {sweep['requests']} requests, Poisson at {sweep['rate_req_s']} req/s; "
        "each cell: TTFT p99 s, ITL p99 / p50 (decode-only steps' p99 / p50: the spread "
        "no bound removes).",
        "",
        f"| batchd prefill bound | {header} |",
        "| --- |" + " ---: |" * len(rounds),
    ]
    for name in _settings(sweep):
        cells = [_cell(r.get(name)) for r in rounds]
        label = "mlx-lm BatchGenerator" if name == BATCHGEN else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, reason in sweep["unavailable"].items():
        lines.append(f"| {key} | {reason} |" + " |" * (len(rounds) - 1))
    return lines


def sweep_headline(sweep: dict[str, Any]) -> str:
    """Each setting's worst round, e.g. ``bound 16 TTFT p99 3.35s ITL 1.62x``: a setting
    meets a target only if it does in every round."""
    parts = []
    for name in _settings(sweep):
        runs = [r[name] for r in sweep["rounds"] if name in r]
        if not runs:
            continue
        ttft = max(f["ttft_p99_s"] for f in runs)
        spreads = [f["itl_spread"] for f in runs if f["itl_spread"]]
        itl = f" ITL {max(spreads):.2f}x" if spreads else ""
        label = "BatchGenerator" if name == BATCHGEN else name
        parts.append(f"{label} TTFT p99 {ttft:.2f}s{itl}")
    return "online sweep, worst round: " + ", ".join(parts)


def _cell(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return ""
    spread = figures["itl_spread"]
    text = f"{figures['ttft_p99_s']:.2f} s, {spread:.2f}x" if spread else "n/a"
    only = figures.get("decode_only_spread")
    return text + (f" ({only:.2f}x)" if only else "")
