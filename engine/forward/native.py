"""The CPU attention and SwiGLU kernels (paged_decode.c), compiled on first use and loaded
by ctypes.

Why a C kernel and not an MLX extension: an extension is built with nanobind and
must match the ABI MLX's wheel was built with; a plain C function over NumPy
views of MLX's buffers needs only a C compiler. Attention runs between two
evaluations of the layer's graph (the new K/V are in the pool, the queries are
computed) and SwiGLU after the gate and up projections, so a step evaluates
twice a layer instead of once a step; on SmolLM2-135M that costs ~0.1 ms each
against the ~1.6 ms a layer the MLX path's block gathers cost (32 sequences of
~300 tokens, 2 cores). Prefill rows go through the same attention kernel as
decode rows of a shorter sequence.

The library is built with the machine's ``cc`` into a cache folder
(``$XDG_CACHE_HOME/batchd/kernels``, else ``~/.cache/batchd/kernels``), named
by a hash of the source, the compiler flags and the CPU's feature flags, so a
copied cache never runs code built for another CPU. Where there is no compiler
or the build fails, :func:`available` is False and the runner keeps MLX's
gather path; ``BATCHD_NATIVE_ATTENTION=0`` asks for that path too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHD_NATIVE_ATTENTION"
SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
    "-pthread",
)


class KernelError(RuntimeError):
    """The kernel refused its arguments or ran out of memory or threads."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchd" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(compiler: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        digest.update(part)
    target = _cache_dir() / f"paged_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builds never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)
    return target


def compiler() -> str | None:
    """The C compiler that builds the kernel: $CC, else cc, else gcc; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def _library() -> ctypes.CDLL | None:
    compiler_path = compiler()
    if compiler_path is None:
        log.info("no C compiler: decode attention gathers KV blocks with MLX")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler_path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning(
            "decode attention kernel not built (%s%s); using MLX's gather path",
            exc,
            f": {detail.decode(errors='replace')[-500:]}" if detail else "",
        )
        return None
    fn = library.batchd_paged_decode
    c_int, c_pointer = ctypes.c_int, ctypes.c_void_p
    # q, k, v, tables, lengths, out; batch, heads, kv_heads, dim; slots; width, block_size;
    # scale; threads
    fn.argtypes = [
        *[c_pointer] * 6,
        *[c_int] * 4,
        ctypes.c_int64,
        c_int,
        c_int,
        ctypes.c_float,
        c_int,
    ]
    fn.restype = ctypes.c_int
    swiglu_fn = library.batchd_swiglu
    swiglu_fn.argtypes = [c_pointer] * 3 + [ctypes.c_int64]
    swiglu_fn.restype = None
    return library


def available() -> bool:
    """Whether the kernel is on (not disabled) and built."""
    return os.environ.get(DISABLE_ENV) != "0" and _library() is not None


def paged_decode(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    *,
    block_size: int,
    scale: float,
    threads: int,
) -> np.ndarray:
    """Attention of ``q`` [B, heads, D] over the pool ``k``/``v`` [kv_heads, slots, D]
    through ``tables`` [B, width] for ``lengths`` [B] keys each -> [B, heads, D] float32."""
    library = _library()
    if library is None:
        raise KernelError("the decode attention kernel is not available")
    batch, heads, dim = q.shape
    kv_heads, slots, _ = k.shape
    arrays = {"q": q, "k": k, "v": v}
    for name, array in arrays.items():
        if array.dtype != np.float32 or not array.flags.c_contiguous or array.shape[-1] != dim:
            raise KernelError(f"{name}: needs C-contiguous float32 [..., {dim}], got {array.dtype}")
    tables = np.ascontiguousarray(tables, dtype=np.int32)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    if tables.size and (tables.min() < 0 or tables.max() >= slots // block_size):
        raise KernelError(f"block ids must be in [0, {slots // block_size}): {tables}")
    out = np.empty((batch, heads, dim), dtype=np.float32)
    status = library.batchd_paged_decode(
        q.ctypes.data,
        k.ctypes.data,
        v.ctypes.data,
        tables.ctypes.data,
        lengths.ctypes.data,
        out.ctypes.data,
        batch,
        heads,
        kv_heads,
        dim,
        slots,
        tables.shape[1],
        block_size,
        scale,
        threads,
    )
    if status != 0:
        raise KernelError(
            f"paged decode failed ({status}): batch {batch}, heads {heads}/{kv_heads}, "
            f"dim {dim}, tables {tables.shape}, block_size {block_size}"
        )
    return out


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up of two C-contiguous float32 arrays of one shape."""
    library = _library()
    if library is None:
        raise KernelError("the native kernels are not available")
    if gate.shape != up.shape:
        raise KernelError(f"gate {gate.shape} and up {up.shape} differ in shape")
    for name, array in (("gate", gate), ("up", up)):
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise KernelError(f"{name}: needs C-contiguous float32, got {array.dtype}")
    out = np.empty_like(gate)
    library.batchd_swiglu(gate.ctypes.data, up.ctypes.data, out.ctypes.data, gate.size)
    return out
