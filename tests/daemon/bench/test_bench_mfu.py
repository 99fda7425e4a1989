"""MFU of the device's peak in `batchd bench`: the model-FLOPs count against a hand count,
the peak's sources (option, datasheet table, none on the CPU) and the report's column."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.config.settings import load_settings
from batchd.daemon.bench import peak
from batchd.daemon.bench.limit import ModelFlops
from batchd.daemon.bench.report import markdown
from batchd.daemon.bench.workloads import Request, Workload
from batchd.daemon.commands import bench as bench_cmd

# hidden 8, 2 heads of 4 over 1 KV head, MLP 16, vocabulary 32, 3 layers.
SMALL = {
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "vocab_size": 32,
    "num_hidden_layers": 3,
}


def small_flops(tmp_path: Path) -> ModelFlops:
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return ModelFlops.from_model_dir(tmp_path)


def test_model_flops_match_a_hand_count(tmp_path: Path) -> None:
    flops = small_flops(tmp_path)
    # Per layer: q and o 8x8 each, k and v 8x4 each, gate, up and down 8x16 each.
    per_layer = 64 + 64 + 32 + 32 + 3 * 128
    assert flops.linear_per_token == 2 * 3 * per_layer == 3456
    assert flops.head_per_token == 2 * 8 * 32 == 512
    assert flops.attention_per_key == 4 * 3 * 2 * 4 == 96
    # A: 5 prompt + 3 output tokens: positions 0..6 fed (the last output's K/V is never
    # needed), 1 + 2 + ... + 7 = 28 keys, the head on 3 tokens. B shares A's first 4
    # prompt ids (the workload's prefix): positions 4..6 of its 6 + 2, 5 + 6 + 7 keys.
    workload = Workload(
        "hand",
        [Request("a", [20, 21, 22, 23, 24], 3), Request("b", [20, 21, 22, 23, 25, 26], 2)],
        shared_prefix_len=4,
    )
    a = 7 * 3456 + 28 * 96 + 3 * 512
    b = 3 * 3456 + 18 * 96 + 2 * 512
    assert flops.workload_flops(workload) == a + b == 41536
    # A system that ran it in 41.536 us did 1 GFLOP/s: 50% of a 0.002 TFLOP/s peak.
    figures = peak.peak_figures(flops, workload, 41.536e-6, peak.Peak(0.002, "test"))
    assert figures == {"model_gflops": 1.0, "mfu_peak": 0.5}
    assert peak.peak_figures(flops, workload, 41.536e-6, None) == {"model_gflops": 1.0}


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.5),
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("AMD EPYC", None),
        ("Apple M2 Max", None),
    ],
)
def test_the_datasheet_table_by_device_name(name: str, tflops: float | None) -> None:
    assert peak.table_peak(name) == tflops


def test_the_peak_comes_from_the_option_else_a_known_gpu() -> None:
    assert peak.resolve_peak(12.5, "AMD EPYC", gpu=False) == peak.Peak(12.5, "--peak-tflops")
    assert peak.resolve_peak(12.5, "NVIDIA H200", gpu=True) == peak.Peak(12.5, "--peak-tflops")
    on_h200 = peak.resolve_peak(None, "NVIDIA H200", gpu=True)
    assert on_h200 is not None and on_h200.tflops == 989.5 and "NVIDIA H200" in on_h200.source
    # MLX on the CPU (whatever GPU the host has), or a GPU the table does not know: none.
    assert peak.resolve_peak(None, "NVIDIA H200", gpu=False) is None
    assert peak.resolve_peak(None, "Apple M2 Max", gpu=True) is None


def test_the_device_name_comes_from_mlx_else_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    if not peak.on_gpu():
        assert peak.device_name() == mx.device_info()["device_name"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=name" ] && echo "NVIDIA H200"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(peak.mx, "device_info", lambda: {})
    monkeypatch.setattr(peak, "on_gpu", lambda: True)
    assert peak.device_name() == "NVIDIA H200"
    fake.write_text("#!/bin/sh\nexit 9\n")  # a failing nvidia-smi names nothing
    assert peak.device_name() == "unknown"


def test_peak_tflops_must_be_a_positive_number() -> None:
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    for bad in ("0", "-3", "abc", "nan", "inf"):
        with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
            parser.parse_args(["bench", "--peak-tflops", bad])
        assert f"expected a positive number of TFLOP/s, got {bad!r}" in err.getvalue()
    assert parser.parse_args(["bench", "--peak-tflops", "989.5"]).peak_tflops == 989.5


def run_bench(model: Path, out: Path, *options: str) -> tuple[dict[str, Any], str]:
    """One tiny-scale bench run; its report.json and report.md."""
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--model", str(model), "--scale", "tiny", "--max-num-seqs", "4"]
        + ["--out", str(out), *options]
    )
    with contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args, load_settings()) == 0
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_the_report_gives_mfu_of_the_peak_asked_for(tiny_model: Path, tmp_path: Path) -> None:
    report, table = run_bench(tiny_model, tmp_path, "--workload", "mixed", "--peak-tflops", "0.5")
    assert report["settings"]["command"].endswith(" --peak-tflops 0.5")
    assert report["limit"]["peak_tflops"] == 0.5
    assert report["limit"]["peak_source"] == "--peak-tflops"
    systems = report["workloads"]["mixed"]["systems"]
    assert {"batchd", "batchgen"} <= set(systems)
    for key, fig in systems.items():
        assert fig["model_gflops"] > 0, key
        assert fig["mfu_peak"] == pytest.approx(fig["model_gflops"] / 500, rel=1e-2), key
    assert "| TTFT p99 s | MFU | MFU of peak |" in table
    ours = systems["batchd"]
    assert f"| {ours['mfu']:.1%} | {ours['mfu_peak'] * 100:.3g}% |" in table
    assert "peak 0.5 TFLOP/s (--peak-tflops)" in table
    shares = f"(MFU of peak {ours['mfu_peak']:.2%} vs {systems['batchgen']['mfu_peak']:.2%})"
    assert report["headline"].startswith("mixed ") and report["headline"].endswith(shares)
    assert "4 x layers x heads x head_dim per (query, key) pair attended" in table
    machine = report["machine"]
    assert machine["device_name"] and machine["device"].startswith("Device(")
    assert f"(default device {machine['device']}, {machine['device_name']})" in table
    # A GGUF kept quantized (smollm2 on a GPU) says so beside its dtype.
    assert report["settings"]["weight_bits"] is None and "(float32), " in table
    report["settings"]["weight_bits"] = 4
    assert "(float32, 4-bit quantized weights), " in markdown(report)


def test_no_mfu_of_peak_on_the_cpu_unless_asked(tiny_model: Path, tmp_path: Path) -> None:
    if peak.on_gpu():
        pytest.skip("MLX runs on a GPU here: its datasheet peak may apply")
    report, table = run_bench(tiny_model, tmp_path, "--workload", "shared-prefix")
    assert report["limit"]["peak_tflops"] is None
    for key, fig in report["workloads"]["shared-prefix"]["systems"].items():
        assert fig["model_gflops"] > 0 and "mfu_peak" not in fig, key
    assert "MFU of peak |" not in table
    assert "MFU of peak: n/a (no --peak-tflops, and no GPU whose peak is known)" in table
    assert "--peak-tflops" not in report["settings"]["command"]
    assert "MFU of peak" not in report["headline"]
