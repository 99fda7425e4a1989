"""The device a bench runs on and its peak FLOP rate: MFU against the datasheet.

The FLOP limit (batchd.daemon.bench.limit) measures a float32 matmul in the run, which
on a CPU is the honest ceiling. On a GPU the usual yardstick is the vendor's dense
bfloat16 peak instead: ``--peak-tflops`` gives it, or the table below when MLX's default
device is a GPU whose name it knows. On the CPU there is no default, and MFU of peak is
not reported unless asked for.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.bench.limit import ModelFlops
from batchd.daemon.bench.workloads import Workload

# Dense bfloat16 tensor-core TFLOP/s (NVIDIA's datasheets give twice these "with
# sparsity"), by a substring of the device name; the first match wins, so the PCIe and
# NVL parts come before the SXM ones they share a name with.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100", 989.5),
    ("H200", 989.5),
    ("A100", 312.0),
)
FLOPS_FORMULA = (
    "model FLOPs = 2 x the layers' projection and MLP weights per position fed through "
    "the model (every prompt position, a shared prefix once, and every output but the "
    "last) + 4 x layers x heads x head_dim per (query, key) pair attended + 2 x hidden x "
    "vocab (the output head) per output token; MFU of peak = model FLOPs / wall time / peak"
)


@dataclass(frozen=True)
class Peak:
    """A peak FLOP rate and where it came from (the option, or the table's entry)."""

    tflops: float
    source: str


def on_gpu() -> bool:
    """Whether MLX's default device (where the models run) is a GPU."""
    return bool(mx.default_device().type == mx.gpu)


def device_name() -> str:
    """The default device's name as MLX gives it (``device_info``), else nvidia-smi's
    first GPU when MLX runs on one, else ``unknown``."""
    try:
        name = str(mx.device_info().get("device_name") or "")
    except (RuntimeError, ValueError):  # a backend without device information
        name = ""
    if not name and on_gpu():
        name = _nvidia_smi_name()
    return name or "unknown"


def _nvidia_smi_name() -> str:
    """The first GPU's name from nvidia-smi, or empty when it is absent or fails."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else ""


def table_peak(name: str) -> float | None:
    """The dense bfloat16 TFLOP/s of a device named ``name``, or None if not in the table."""
    for part, tflops in PEAK_BF16_TFLOPS:
        if part.lower() in name.lower():
            return tflops
    return None


def resolve_peak(option: float | None, name: str, *, gpu: bool) -> Peak | None:
    """``--peak-tflops`` if given; else the table's figure for a GPU named ``name``;
    else None (the CPU, or a GPU the table does not know)."""
    if option is not None:
        return Peak(option, "--peak-tflops")
    tflops = table_peak(name) if gpu else None
    if tflops is None:
        return None
    return Peak(tflops, f"{name}: bf16 dense, NVIDIA datasheet")


def peak_figures(
    flops: ModelFlops, workload: Workload, wall_s: float, peak: Peak | None
) -> dict[str, Any]:
    """One system's achieved model GFLOP/s on ``workload`` (the requests it ran, in
    ``wall_s``), and its MFU of ``peak`` where one is known."""
    if wall_s <= 0:
        return {}
    achieved = flops.workload_flops(workload) / wall_s / 1e9
    figures: dict[str, Any] = {"model_gflops": round(achieved, 3)}
    if peak is not None:
        figures["mfu_peak"] = round(achieved / (peak.tflops * 1e3), 5)
    return figures
