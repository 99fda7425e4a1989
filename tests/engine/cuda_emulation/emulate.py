"""Run an `mx.fast.cuda_kernel` body on the CPU to check its logic without a GPU.

The body is wrapped exactly as MLX wraps it (spec.build_kernel_source), with
cuda_emu.h in place of MLX's device headers, compiled by g++ into a shared library
and launched through ctypes on numpy buffers. cuda_emu.h explains the execution
model: blocks one at a time, a block's threads as std::threads, `__shared__` as
function statics (one copy, shared by the running block). `extern __shared__`
declarations are rewritten here into pointers to the launch's dynamic shared buffer.

Grid and threadgroup are in MLX's units: grid counts threads, blocks =
ceil(grid / threadgroup), block = min(threadgroup, grid) per axis.

dtypes: an input declared "bfloat16" takes float32 (rounded to nearest even, like
`astype(mx.bfloat16)`) or uint16 (raw bits); "float16" takes np.float16; every other
dtype must match exactly. A bfloat16 output comes back as float32 (exact). Outputs
start as NaN (floats) or 0x5A5A... (integers) unless `init_value` is given, so an
element the kernel forgets to write shows up.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .spec import CUDA_TYPES, KernelSpec, build_kernel_source

HEADER = Path(__file__).with_name("cuda_emu.h")
CXX_FLAGS = ["-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-fvisibility=hidden"]
MAX_NDIM = 10
MAX_THREADS_PER_BLOCK = 1024
MAX_SHARED_BYTES = 232448  # an H100/H200 block's dynamic shared memory limit (227 KiB)

_NUMPY: dict[str, type[np.generic]] = {
    "bool": np.bool_,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
}
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*|alignas\s*\(\s*\d+\s*\)\s*)?"
    r"([A-Za-z_][\w:<>, ]*?)\s+(\w+)\s*\[\s*\]\s*;"
)
_LAUNCHER = """
extern "C" __attribute__((visibility("default"))) int emu_launch(
    void** bufs, const std::int64_t* meta, const unsigned* dims, std::size_t smem,
    double deadlock_seconds, char* err, std::size_t err_len) {
  auto shape = [&](int i) { Shape s{}; for (int d = 0; d < MAX_NDIM; ++d)
    s[d] = static_cast<std::int32_t>(meta[i * 21 + 1 + d]); return s; };
  auto strides = [&](int i) { Strides s{}; for (int d = 0; d < MAX_NDIM; ++d)
    s[d] = meta[i * 21 + 11 + d]; return s; };
  emu::deadlock_seconds = deadlock_seconds;
  return emu::launch(dim3{dims[0], dims[1], dims[2]}, dim3{dims[3], dims[4], dims[5]}, smem,
      [&] { mlx::core::cu::KERNEL(ARGS); }, err, err_len);
}
"""
_loaded: dict[str, ctypes.CDLL] = {}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN -> 0x7FFF."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), rounded)


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """`x` rounded to bfloat16 and back to float32: the reference value of a bf16 store."""
    return bf16_to_float(bf16_bits(x))


def emulation_source(spec: KernelSpec, input_ndims: list[int] | None = None) -> str:
    """The C++ translation unit the emulator compiles for `spec`."""
    header = _EXTERN_SHARED.sub(_extern_shared_pointer, spec.header)
    source = _EXTERN_SHARED.sub(_extern_shared_pointer, spec.source)
    patched = KernelSpec(spec.name, spec.inputs, spec.outputs, source, header, spec.template)
    ndims = input_ndims if input_ndims is not None else [1] * len(spec.inputs)
    tu = build_kernel_source(patched, '#include "cuda_emu.h"\n', ndims)
    launcher = _LAUNCHER.replace("KERNEL", spec.kernel_name).replace(
        "ARGS", _call_args(spec, ndims)
    )
    return tu + launcher


def _extern_shared_pointer(m: re.Match[str]) -> str:
    ctype, name = m.group(1).strip(), m.group(2)
    return f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(emu::dynamic_smem);"


def _call_args(spec: KernelSpec, ndims: list[int]) -> str:
    args = []
    for i, ((_name, dtype), ndim, info) in enumerate(
        zip(spec.inputs, ndims, spec.shape_infos(), strict=True)
    ):
        args.append(f"static_cast<const {CUDA_TYPES[dtype]}*>(bufs[{i}])")
        if ndim > 0:
            wanted = (f"shape({i})", f"strides({i})", f"static_cast<int>(meta[{i} * 21])")
            args.extend(a for a, w in zip(wanted, info, strict=True) if w)
    for j, (_, dtype) in enumerate(spec.outputs):
        args.append(f"static_cast<{CUDA_TYPES[dtype]}*>(bufs[{len(spec.inputs) + j}])")
    return ", ".join(args)


def _compile(tu: str) -> ctypes.CDLL:
    """Build the shared library for `tu`, reused while source, headers and flags are unchanged."""
    headers = "".join(h.read_text() for h in sorted(HEADER.parent.glob("*.h")))
    key = hashlib.sha256((tu + headers + " ".join(CXX_FLAGS)).encode()).hexdigest()[:24]
    if key in _loaded:
        return _loaded[key]
    cache = Path(tempfile.gettempdir()) / "batchd_cuda_emu"
    cache.mkdir(exist_ok=True)
    lib = cache / f"{key}.so"
    if not lib.exists():
        src = cache / f"{key}.{os.getpid()}.cpp"
        src.write_text(tu)
        tmp = cache / f"{key}.{os.getpid()}.so"
        cmd = ["g++", *CXX_FLAGS, f"-I{HEADER.parent}", str(src), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            numbered = "\n".join(f"{i + 1:4d} {ln}" for i, ln in enumerate(tu.splitlines()))
            raise RuntimeError(f"g++ failed on the emulated kernel:\n{done.stderr}\n{numbered}")
        os.replace(tmp, lib)  # atomic: a concurrent test process never loads a partial file
        src.unlink()
    _loaded[key] = ctypes.CDLL(str(lib))
    return _loaded[key]


def _launch_dims(grid: Sequence[int], threadgroup: Sequence[int]) -> list[int]:
    """MLX's CustomKernel::eval_gpu: blocks = ceil(grid / tg), block = min(tg, grid)."""
    if len(grid) != 3 or len(threadgroup) != 3 or min(*grid, *threadgroup) < 1:
        raise ValueError(f"grid {grid} and threadgroup {threadgroup} need 3 positive sizes")
    blocks = [(g + t - 1) // t for g, t in zip(grid, threadgroup, strict=True)]
    block = [min(t, g) for g, t in zip(grid, threadgroup, strict=True)]
    if block[0] * block[1] * block[2] > MAX_THREADS_PER_BLOCK or block[2] > 64:
        raise ValueError(f"block {block} exceeds CUDA's limits (1024 threads, z <= 64)")
    return blocks + block


def _input_buffer(name: str, dtype: str, x: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16" and x.dtype in (np.float32, np.float64):
        return bf16_bits(x)
    if dtype == "bfloat16" and x.dtype.name == "bfloat16":  # ml_dtypes
        return np.ascontiguousarray(x).view(np.uint16)
    if x.dtype != _NUMPY[dtype]:
        raise TypeError(f"input {name!r} is declared {dtype} but the array is {x.dtype}")
    return np.ascontiguousarray(x)


def _output_buffer(dtype: str, shape: Sequence[int], init_value: float | None) -> np.ndarray:
    np_type = _NUMPY[dtype]
    if dtype == "bfloat16":
        fill = bf16_bits(np.array(np.nan if init_value is None else init_value, np.float32))
        return np.full(shape, fill, dtype=np.uint16)
    if init_value is not None:
        return np.full(shape, init_value, dtype=np_type)
    if np.issubdtype(np_type, np.floating):
        return np.full(shape, np.nan, dtype=np_type)
    count = int(np.prod(shape, dtype=np.int64))
    return np.full(count * np.dtype(np_type).itemsize, 0x5A, np.uint8).view(np_type).reshape(shape)


def _meta(arrays: list[np.ndarray]) -> np.ndarray:
    """Per input: ndim, shape[10], strides[10] (in elements), as MLX passes Shape/Strides."""
    meta = np.zeros((max(len(arrays), 1), 1 + 2 * MAX_NDIM), dtype=np.int64)
    for i, a in enumerate(arrays):
        if a.ndim > MAX_NDIM:
            raise ValueError(f"input {i} has {a.ndim} dims; MLX passes at most {MAX_NDIM}")
        meta[i, 0] = a.ndim
        meta[i, 1 : 1 + a.ndim] = a.shape
        meta[i, 11 : 11 + a.ndim] = [s // a.itemsize for s in a.strides]
    return meta


def run_kernel(
    spec: KernelSpec,
    inputs: Mapping[str, np.ndarray],
    output_shapes: Sequence[Sequence[int]],
    grid: Sequence[int],
    threadgroup: Sequence[int],
    shared_memory: int = 0,
    init_value: float | None = None,
    deadlock_seconds: float = 20.0,
) -> list[np.ndarray]:
    """Launch `spec` on the CPU like `mx.fast.cuda_kernel(...)(inputs=..., ...)` on a GPU.

    Returns one array per output (bfloat16 outputs as float32). Raises RuntimeError
    if g++ rejects the body, or if a barrier or shuffle deadlocks (not every thread of
    the block/warp arrives within `deadlock_seconds`).
    """
    if set(inputs) != {n for n, _ in spec.inputs}:
        raise ValueError(f"inputs {sorted(inputs)} != declared {[n for n, _ in spec.inputs]}")
    if len(output_shapes) != len(spec.outputs):
        raise ValueError(f"{len(output_shapes)} output shapes for {len(spec.outputs)} outputs")
    if not 0 <= shared_memory <= MAX_SHARED_BYTES:
        raise ValueError(f"shared_memory={shared_memory} outside [0, {MAX_SHARED_BYTES}]")
    ins = [_input_buffer(n, d, inputs[n]) for n, d in spec.inputs]
    outs = [
        _output_buffer(d, s, init_value)
        for (_, d), s in zip(spec.outputs, output_shapes, strict=True)
    ]
    lib = _compile(emulation_source(spec, [a.ndim for a in ins]))
    bufs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[a.ctypes.data for a in ins + outs])
    meta = _meta(ins)
    dims = (ctypes.c_uint * 6)(*_launch_dims(grid, threadgroup))
    err = ctypes.create_string_buffer(1024)
    lib.emu_launch.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_size_t,
        ctypes.c_double,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    code = lib.emu_launch(
        bufs, meta.ctypes.data, dims, shared_memory, deadlock_seconds, err, len(err)
    )
    if code != 0:
        raise RuntimeError(f"kernel {spec.kernel_name} failed: {err.value.decode()}")
    return [
        bf16_to_float(o) if d == "bfloat16" else o
        for o, (_, d) in zip(outs, spec.outputs, strict=True)
    ]


def gxx_available() -> bool:
    """Whether the emulator can build kernels here (g++ on PATH)."""
    return shutil.which("g++") is not None
