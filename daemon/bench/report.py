"""The report a person reads: JSON with every figure, a markdown table, a PNG chart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from batchd.daemon.bench.engine_system import backends_lines
from batchd.daemon.bench.speculative import speculative_lines
from batchd.daemon.bench.sweep import sweep_lines
from batchd.daemon.bench.systems import BATCHD, BATCHGEN, LABELS, OFFLINE_ORDER
from batchd.daemon.bench.workloads import LATENCY_WORKLOADS, THROUGHPUT_WORKLOADS
from batchd.engine.config import EngineConfig

JSON_NAME, MARKDOWN_NAME, CHART_NAME = "report.json", "report.md", "report.png"
_COLORS = {BATCHD: "#1f77b4", BATCHGEN: "#ff7f0e", "static": "#2ca02c", "sequential": "#7f7f7f"}


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.json, report.md and report.png into ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / JSON_NAME, out_dir / MARKDOWN_NAME, out_dir / CHART_NAME]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    chart(report, paths[2])
    return paths


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _bound(value: int | None) -> str:
    return "none" if value is None else str(value)


def _throughput_results(report: dict[str, Any]) -> dict[str, Any]:
    return {n: r for n, r in report["workloads"].items() if n in THROUGHPUT_WORKLOADS}


# Named in the settings line already, or set by the bench for each run.
_SHOWN = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_prefill_tokens_with_decodes",
    "prefill_fills_row_tile",
    "num_kv_blocks",
}


def _other_engine_options(settings: dict[str, Any]) -> str:
    """batchd's engine options set away from their defaults (block size, prefix caching,
    dtype...), for the settings line; reports from before they were recorded have none."""
    engine = settings.get("engine", {})
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    changed = [
        f"{name} {value}"
        for name, value in engine.items()
        if name not in _SHOWN and name in defaults and value != defaults[name]
    ]
    return "".join(f"{part}, " for part in changed)


def markdown(report: dict[str, Any]) -> str:
    """Settings, throughput table (with ratios, MFU and the FLOP limit), latency table."""
    s, m, limit = report["settings"], report["machine"], report["limit"]
    # The online workloads name their own prefill bounds; the engine setting is the others'.
    bound = (
        f"max_prefill_tokens_with_decodes {_bound(s['max_prefill_tokens_with_decodes'])}, "
        if set(report["workloads"]) - set(LATENCY_WORKLOADS)
        else ""
    )
    # Reports from before the setting existed do not name it.
    if "prefill_fills_row_tile" in s:
        bound += f"prefill_fills_row_tile {'on' if s['prefill_fills_row_tile'] else 'off'}, "
    lines = [
        "# batchd bench",
        "",
        f"Model `{s['model_label']}` ({s['dtype']}"
        f"{_given(s, 'weight_bits', ', {}-bit quantized weights')}), "
        f"max_num_seqs {s['max_num_seqs']}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, {bound}"
        f"{_other_engine_options(s)}scale {s['scale']}.",
        f"Machine: {m['platform']}, {_given(m, 'cpu', '{}, ')}{m['cpu_count']} CPUs, "
        f"mlx {m['mlx']} (default device {m['device']}{_given(m, 'device_name', ', {}')}), "
        f"mlx-lm {m['mlx_lm']}, BLAS {m['blas']}{_given(m, 'blas_kernels', ' ({} kernels)')}; "
        f"matmul {limit['matmul_gflops']} GFLOP/s.",
    ]
    lines += _throughput_lines(report)
    online = report["workloads"].get("online")
    if online is not None:
        lines += [
            "",
            f"Online: {online['requests']} requests, Poisson at {online['rate_req_s']} req/s "
            f"({online['load']:.0%} of BatchGenerator's mixed throughput); batchd with "
            f"max_prefill_tokens_with_decodes "
            f"{_bound(s['online_max_prefill_tokens_with_decodes'])} (a latency setting: "
            "the throughput workloads use the value above).",
            "",
            "| system | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for fig in online["systems"].values():
            lines.append(
                f"| {fig['label']} | {fig['tok_s']:.1f} | {fig['ttft_p50_s']:.3f} "
                f"| {fig['ttft_p99_s']:.3f} | {fig['itl_p50_s'] * 1e3:.1f} "
                f"| {fig['itl_p99_s'] * 1e3:.1f} |"
            )
        for key, reason in online["unavailable"].items():
            lines.append(f"| {LABELS[key]} | {reason} | | | | |")
        steps = online["systems"].get(BATCHD, {}).get("engine_steps")
        if steps:
            lines += ["", _steps_line(steps)]
    lines += _later_lines(report["workloads"])
    lines += ["", f"**{report['headline']}**", ""]
    return "\n".join(lines)


def _throughput_lines(report: dict[str, Any]) -> list[str]:
    """The throughput table: MFU of the FLOP limit (the run's matmul rate) per system,
    and MFU of the device's peak where the report has one (--peak-tflops, or a GPU's
    datasheet), then how both are computed."""
    throughput = _throughput_results(report)
    if not throughput:
        return []
    peak = report["limit"].get("peak_tflops")
    # The MFU of peak column: only in reports with a peak.
    extra, cell = (" MFU of peak |", " |") if peak else ("", "")
    lines = [
        "",
        "| workload | system | requests | output tokens | tok/s | batchd vs it "
        f"| TTFT p50 s | TTFT p99 s | MFU |{extra}",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if peak else ""),
    ]
    for name, result in throughput.items():
        ratios = result.get("ratios", {})
        for key, fig in result["systems"].items():
            of_peak = f" {_share(fig.get('mfu_peak'))} |" if peak else ""
            lines.append(
                f"| {name} | {fig['label']} | {fig['requests']} | {fig['output_tokens']} "
                f"| {fig['tok_s']:.1f} | {_ratio(ratios.get(f'vs_{key}'))} "
                f"| {fig['ttft_p50_s']:.3f} | {fig['ttft_p99_s']:.3f} | {fig['mfu']:.1%} |"
                + of_peak
            )
        for key, reason in result["unavailable"].items():
            lines.append(f"| {name} | {LABELS[key]} | | | {reason} | | | | |{cell}")
        lim = result["limit"]
        lines.append(
            f"| {name} | FLOP limit ({lim['workload_gflop']} GFLOP) | {result['requests']} "
            f"| {result['output_tokens']} | {lim['limit_tok_s']:.0f} | | | | 100% |{cell}"
        )
    return [*lines, "", _mfu_note(report["limit"])]


def _mfu_note(limit: dict[str, Any]) -> str:
    """How MFU and MFU of peak are computed, and the peak's source (reports from before
    the peak was recorded have neither)."""
    note = "MFU: tok/s over the FLOP limit's tok/s (at the run's float32 matmul rate)."
    if "flops_formula" not in limit:
        return note
    note += f" {limit['flops_formula'][0].upper()}{limit['flops_formula'][1:]}"
    if limit.get("peak_tflops"):
        return note + f"; peak {limit['peak_tflops']:g} TFLOP/s ({limit['peak_source']})."
    return note + "; MFU of peak: n/a (no --peak-tflops, and no GPU whose peak is known)."


def _share(value: float | None) -> str:
    """A fraction as a percentage to 3 significant digits: a small model's MFU of a
    GPU's peak can be a small fraction of a percent."""
    return "n/a" if value is None else f"{value * 100:.3g}%"


def _later_lines(results: dict[str, Any]) -> list[str]:
    """The sections of the online sweep, the queue and speculative decoding, if run."""
    lines: list[str] = []
    sweep = results.get("online-sweep")
    if sweep is not None:
        lines += sweep_lines(sweep)
    q = results.get("queue")
    if q is not None:
        lines += ["", _queue_line(q)]
    spec = results.get("speculative")
    if spec is not None:
        lines += ["", *speculative_lines(spec)]
    if "backends" in results:
        lines += ["", *backends_lines(results["backends"])]
    return lines


def _steps_line(steps: dict[str, Any]) -> str:
    """batchd's own step times in the online run, split by whether a step carried prefill."""

    def ms(key: str) -> str:
        return f"{steps[key] * 1e3:.1f}"

    def spread(p50: str, p99: str) -> float:
        return steps[p99] / steps[p50] if steps[p50] else 0.0

    line = (
        "batchd's engine steps, weighted by the decodes each holds up: all p50 / p99 "
        f"{ms('step_p50_s')} / {ms('step_p99_s')} ms; decode-only steps "
        f"{ms('decode_only_p50_s')} / {ms('decode_only_p99_s')} ms "
        f"({spread('decode_only_p50_s', 'decode_only_p99_s'):.2f}x: ITL p99 / p50 "
        "with no prefill at all, machine jitter and batch sizes alone); steps carrying prefill "
        f"{ms('with_prefill_p50_s')} / {ms('with_prefill_p99_s')} ms, "
        f"{steps['gap_share_with_prefill']:.0%} of the gaps."
    )
    if "device_wait_p50_s" in steps:  # reports before the step's one sync have none
        line += (
            f" Per step (p50): {steps['host_hidden_p50_s'] * 1e3:.2f} ms of host work hidden "
            f"under the device's, {steps['device_wait_p50_s'] * 1e3:.2f} ms waiting for it."
        )
    if not steps["same_batch_steps"]:
        return line
    batch = steps["same_batch_decodes"]
    return line + (
        f" The {steps['same_batch_steps']} decode-only steps of {batch} "
        f"sequence{'s' if batch > 1 else ''}, the commonest batch, {ms('same_batch_p50_s')} / "
        f"{ms('same_batch_p99_s')} ms ({spread('same_batch_p50_s', 'same_batch_p99_s'):.2f}x: "
        "the same work every step but for the contexts' growth, the machine's jitter)."
    )


def _queue_line(q: dict[str, Any]) -> str:
    if not q.get("available"):
        return f"Queue: {q['reason']}."
    shown = q["queue"]["tok_s"] / q["reference_tok_s"] if q["reference_tok_s"] else 0.0
    return (
        f"Queue: {q['ratio']:.2f}x in-process{_queue_rounds(q)} The round nearest it: "
        f"{q['queue']['tok_s']:.1f} tok/s through Redis vs {q['reference_tok_s']:.1f} "
        f"in-process (mean of {q['in_process']['tok_s']:.1f} before and "
        f"{q['in_process_after']['tok_s']:.1f} after), {shown:.2f}x. The client "
        f"(submit + follow{_subscriber_nice(q['queue'])}) used "
        f"{q['queue']['subscriber_cpu_s']:.2f} CPU-s of that "
        f"{q['queue']['wall_s']:.1f} s run{_redis_cpu(q['queue'])}.{_daemon_publishing(q)}"
    )


def _subscriber_nice(run: dict[str, Any]) -> str:
    # Reports from before the client ran at a low priority have no niceness.
    nice = run.get("subscriber_nice")
    if nice is None:
        return ""
    return f", on a thread at nice {nice}, standing for clients on other machines"


def _daemon_publishing(q: dict[str, Any]) -> str:
    """The daemon's engine thread on publishes against its engine steps, over the rounds
    (reports from before the daemon's metrics were read have none)."""
    rounds = [
        r for r in q.get("rounds", []) if r.get("daemon_publish_s") and r.get("daemon_step_s")
    ]
    if not rounds:
        return ""
    shares = [r["daemon_publish_s"] / r["daemon_step_s"] for r in rounds]
    run = q["queue"]
    shown = ""
    if run.get("daemon_publish_s") and run.get("daemon_step_s"):
        shown = (
            f" In that run {run['daemon_publish_s']:.3f} s on "
            f"{run['daemon_publishes']:.0f} publishes against {run['daemon_step_s']:.2f} s of"
            " engine steps."
        )
    return (
        " The daemon's engine thread spent "
        f"{min(shares):.1%}-{max(shares):.1%} of its engine-step time publishing (building "
        f"each pipeline, waiting for Redis's replies, applying them), by round.{shown}"
    )


def _redis_cpu(run: dict[str, Any]) -> str:
    # Reports written before Redis's CPU time was recorded have none.
    cpu = run.get("redis_cpu_s")
    return "" if cpu is None else f", Redis {cpu:.2f} CPU-s"


def _queue_rounds(q: dict[str, Any]) -> str:
    """The alternating rounds behind the ratio (see batchd.daemon.bench.queue)."""
    rounds = q.get("rounds", [])
    if len(rounds) < 2:
        return "."
    each = ", ".join(f"{r['ratio']:.2f}x" for r in rounds)
    return (
        f", the median of {len(rounds)} rounds (in-process and queue runs alternating, each"
        f" queue run over the mean of its neighbours): {each}; best-of"
        f" {q['best_of_ratio']:.2f}x."
    )


def chart(report: dict[str, Any], path: Path) -> None:
    """Throughput bars per system and workload (FLOP limit marked); TTFT distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    _throughput_panel(bars, report)
    _ttft_panel(ttft, report)
    fig.suptitle(f"batchd bench: {report['settings']['model_label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _throughput_panel(ax: Any, report: dict[str, Any]) -> None:
    """Grouped bars, one group per throughput workload, log scale, the FLOP limit dotted."""
    offline = _throughput_results(report)
    if not offline:
        ax.text(0.5, 0.5, "no throughput workload in this run", ha="center", va="center")
        ax.set_axis_off()
        return
    width = 0.8 / len(OFFLINE_ORDER)
    for i, key in enumerate(OFFLINE_ORDER):
        xs = [n for n, r in enumerate(offline.values()) if key in r["systems"]]
        values = [r["systems"][key]["tok_s"] for r in offline.values() if key in r["systems"]]
        drawn = ax.bar(
            [x + (i - (len(OFFLINE_ORDER) - 1) / 2) * width for x in xs],
            values,
            width,
            label=LABELS[key],
            color=_COLORS[key],
        )
        ax.bar_label(drawn, fmt="%.0f", fontsize="x-small")
    for x, result in enumerate(offline.values()):
        ax.hlines(result["limit"]["limit_tok_s"], x - 0.45, x + 0.45, colors="k", linestyles=":")
    ax.set_xticks(range(len(offline)), list(offline))
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["limit"]["limit_tok_s"] for r in offline.values()) * 8)
    ax.set_title("Throughput, log scale (dotted: FLOP limit)")
    ax.legend(fontsize="small", loc="upper left", ncol=2)


def _ttft_panel(ax: Any, report: dict[str, Any]) -> None:
    """TTFT CDF: online arrivals if measured, else the mixed workload's all-at-once TTFTs."""
    results = report["workloads"]
    source = "online" if results.get("online", {}).get("systems") else "mixed"
    systems = results.get(source, {}).get("systems", {})
    for key in (BATCHD, BATCHGEN):
        if key not in systems:
            continue
        values = sorted(systems[key]["ttft_s"])
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=LABELS[key], color=_COLORS[key])
    ax.set_xlabel("time to first token, s")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT distribution ({source})")
    if systems:
        ax.legend(fontsize="small")


def _given(record: dict[str, Any], key: str, form: str) -> str:
    """``form`` filled with ``record[key]``, or nothing where the value is absent or empty:
    reports from before a field was recorded lack it (unquantized weights have no bits)."""
    value = record.get(key)
    return form.format(value) if value else ""
