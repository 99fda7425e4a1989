"""The gateway workload's report: report.json with every figure, report.md with a table.

The same file names as the model workloads' report (batchd.daemon.bench.report), which
this module does not import: that one loads MLX and mlx-lm, and importing mlx-lm lowers
the process's open-files limit, which the gateway bench needs for a socket per request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchd.daemon.bench.gateway.load import GATEWAY_WORKLOAD, SCENARIOS, scenario_line

JSON_NAME, MARKDOWN_NAME = "report.json", "report.md"
# What each scenario is, for the table's first column.
_SCENARIO_TITLES = {
    "rps16": "{requests} requests, 16 in flight",
    "rps256": "{requests} requests, 256 in flight",
    "burst": "{burst} requests sent at once",
    "sse": "{streams} SSE streams open at once",
    "restart": "Redis stopped and restarted (AOF) under 16 in flight",
}


def write_gateway_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.json and report.md into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / JSON_NAME, out_dir / MARKDOWN_NAME]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    return paths


def markdown(report: dict[str, Any]) -> str:
    """Settings and machine, one table row per scenario, the headline."""
    s, m = report["settings"], report["machine"]
    results = report["workloads"][GATEWAY_WORKLOAD]
    lines = [
        "# batchd bench: gateway",
        "",
        f"redis-server (AOF), `batchd serve` on `{s['model']}` and `batchd gateway`, each "
        f"its own process; short greedy chat completions of {s['max_tokens']} tokens from raw "
        "sockets on 127.0.0.1.",
        "",
        f"Machine: {m['cpu']} ({m['cpu_count']} CPUs), {m['platform']}, "
        f"Python {m['python']}, batchd {m['batchd']}.",
        "",
        "| scenario | result |",
        "| --- | --- |",
    ]
    lines += [
        f"| {_SCENARIO_TITLES[name].format(**s)} | {scenario_line(name, results[name])} |"
        for name in SCENARIOS
        if name in results
    ]
    lines += ["", report["headline"], ""]
    if s.get("command"):
        lines += [f"Command: `{s['command']}`", ""]
    return "\n".join(lines)
