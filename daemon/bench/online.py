"""The online workload: the mixed requests arriving as a Poisson process.

The rate is set near the peer's saturation: ``load`` times the requests/s
that BatchGenerator sustained on the mixed workload in this same run. Near
saturation a slower system's queue grows and its TTFT with it, so the
latencies side by side show what throughput headroom buys.
"""

from __future__ import annotations

from typing import Any

from batchd.daemon.bench.stats import RunStats
from batchd.daemon.bench.systems import BATCHD, BATCHGEN, LABELS, Systems, SystemUnavailable
from batchd.daemon.bench.workloads import Workload, poisson_arrivals


def saturation_rate(*, peer_tok_s: float, workload: Workload, load: float) -> float:
    """Requests/s at ``load`` times the peer's measured throughput on ``workload``."""
    mean_output = workload.output_tokens / len(workload.requests)
    return load * peer_tok_s / mean_output


def run_online(
    systems: Systems, workload: Workload, *, rate: float, load: float, seed: int
) -> dict[str, Any]:
    """batchd and BatchGenerator on the same arrival times; TTFT / ITL percentiles."""
    arrivals = poisson_arrivals(n=len(workload.requests), rate=rate, seed=seed)
    result: dict[str, Any] = {
        "requests": len(workload.requests),
        "rate_req_s": round(rate, 4),
        "load": load,
        "arrival_span_s": round(arrivals[-1], 3),
        "systems": {},
        "unavailable": {},
    }
    runs: dict[str, RunStats] = {}
    for key in (BATCHD, BATCHGEN):
        try:
            runs[key] = systems.timed(
                key,
                workload,
                arrivals,
                prefill_bound=systems.settings.online_max_prefill_tokens_with_decodes,
            )
        except SystemUnavailable as exc:
            result["unavailable"][key] = str(exc)
            continue
        result["systems"][key] = {"label": LABELS[key], **runs[key].summary()}
    if BATCHD in runs and BATCHGEN in runs:
        ours, peer = result["systems"][BATCHD], result["systems"][BATCHGEN]
        # Latency ratios read "peer over batchd": above 1 means batchd is faster.
        result["ratios"] = {
            metric: round(peer[metric] / ours[metric], 3) if ours[metric] > 0 else None
            for metric in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
        }
    return result
