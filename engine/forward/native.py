"""The CPU kernels (paged_decode.c: attention and SwiGLU; products.c: matrix products over
packed weights and RMSNorm), compiled on first use and loaded by ctypes.

Why a C kernel and not an MLX extension: an extension is built with nanobind and
must match the ABI MLX's wheel was built with; a plain C function over NumPy
views of MLX's buffers needs only a C compiler. Attention runs between two
evaluations of the layer's graph (the new K/V are in the pool, the queries are
computed) and SwiGLU after the gate and up projections, so a step evaluates
twice a layer instead of once a step, which costs far less than the MLX path's block
gathers. Prefill rows go through the same attention kernel as
decode rows of a shorter sequence.

The library is built with the machine's ``cc`` into the engine's cache folder
(:func:`batchd.engine.cache.kernel_cache`: ``$BATCHD_HOME/kernels``, else
``~/.cache/batchd/kernels`` or the platform's equivalent), named
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from batchd.engine.cache import kernel_cache

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHD_NATIVE_ATTENTION"
# BATCHD_NATIVE_PRODUCTS=0 keeps MLX's (OpenBLAS's) matrix products under the C attention.
PRODUCTS_DISABLE_ENV = "BATCHD_NATIVE_PRODUCTS"
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("team.c", "paged_decode.c", "products.c", "rows.c")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("fast_exp.h", "simd.h", "team.h"))
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
    "-pthread",
)
LIBRARIES = ("-lm",)
NO_KERNELS_COST = (
    "decode attention and the CPU matrix products run on MLX's path instead, about half "
    "the throughput on a CPU; install a C compiler (Debian/Ubuntu: apt-get install gcc)"
)


class KernelError(RuntimeError):
    """The kernel refused its arguments or ran out of memory or threads."""


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
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (sources, " ".join(FLAGS + LIBRARIES).encode(), _cpu_flags().encode()):
        digest.update(part)
    target = kernel_cache() / f"kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builds never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), *LIBRARIES],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)
    return target


def compiler() -> str | None:
    """The C compiler that builds the kernel: $CC, else cc, else gcc; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@dataclass(frozen=True)
class KernelBuild:
    """The outcome of building the kernels once: the library, or why there is none."""

    library: ctypes.CDLL | None
    detail: str  # the shared library's path, or the reason it was not built


def _compile() -> KernelBuild:
    compiler_path = compiler()
    if compiler_path is None:
        return KernelBuild(None, f"no C compiler (cc or gcc; $CC): {NO_KERNELS_COST}")
    try:
        path = _build(compiler_path)
        return KernelBuild(ctypes.CDLL(str(path)), str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-500:]
        reason = f"{exc}: {detail}" if detail else str(exc)
        return KernelBuild(None, f"the build failed ({reason}): {NO_KERNELS_COST}")


@cache
def _build_once() -> KernelBuild:
    built = _compile()
    if built.library is None:
        # Said once a process, as a warning: the fallback works but costs half the speed.
        log.warning("C kernels not built: %s", built.detail)
    else:
        _declare(built.library)
    return built


def _library() -> ctypes.CDLL | None:
    return _build_once().library


def describe() -> str:
    """What this machine runs for the CPU kernels, in a line (``batchd doctor``)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"off ({DISABLE_ENV}=0): {NO_KERNELS_COST}"
    built = _build_once()
    return f"built ({built.detail})" if built.library is not None else built.detail


def _declare(library: ctypes.CDLL) -> None:
    """Set the argument and result types of the library's functions."""
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
    c_int64 = ctypes.c_int64
    product_fn = library.batchd_product
    # x, m, k, panels, bias, n, y, swiglu, threads
    product_fn.argtypes = [c_pointer, c_int64, c_int64, c_pointer, c_pointer, c_int64]
    product_fn.argtypes += [c_pointer, c_int, c_int]
    product_fn.restype = c_int
    norm_fn = library.batchd_rms_norm
    norm_fn.argtypes = [c_pointer] * 3 + [c_int64, c_int64, ctypes.c_float]
    norm_fn.restype = None
    rope_fn = library.batchd_rope_store
    # qkv, n, heads, kv_heads, dim, table, traditional, q_norm, k_norm, eps, q_out, k_pool,
    # v_pool, pool_slots, slots
    rope_fn.argtypes = [c_pointer, c_int64, c_int, c_int, c_int, c_pointer, c_int]
    rope_fn.argtypes += [c_pointer, c_pointer, ctypes.c_float, c_pointer, c_pointer, c_pointer]
    rope_fn.argtypes += [c_int64, c_pointer]
    rope_fn.restype = c_int
    library.batchd_panel_width.argtypes = []
    library.batchd_panel_width.restype = c_int
    library.batchd_tile_rows.argtypes = []
    library.batchd_tile_rows.restype = c_int


def available() -> bool:
    """Whether the kernel is on (not disabled) and built."""
    return os.environ.get(DISABLE_ENV) != "0" and _library() is not None


def products_enabled() -> bool:
    """Whether the C products over packed weights are on (they need the kernels too)."""
    return os.environ.get(PRODUCTS_DISABLE_ENV) != "0" and available()


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
    library = _loaded()
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
    library = _loaded()
    if gate.shape != up.shape:
        raise KernelError(f"gate {gate.shape} and up {up.shape} differ in shape")
    for name, array in (("gate", gate), ("up", up)):
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise KernelError(f"{name}: needs C-contiguous float32, got {array.dtype}")
    out = np.empty_like(gate)
    library.batchd_swiglu(gate.ctypes.data, up.ctypes.data, out.ctypes.data, gate.size)
    return out


def _loaded() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise KernelError("the native kernels are not available")
    return library


def _check_float32(name: str, array: np.ndarray, ndim: int) -> None:
    if array.dtype != np.float32 or not array.flags.c_contiguous or array.ndim != ndim:
        raise KernelError(
            f"{name}: needs a C-contiguous float32 array of {ndim} dimensions, got "
            f"{array.dtype} {array.shape}"
        )


def panel_width() -> int:
    """Columns in a panel of packed weights (twice the CPU's float vector width)."""
    return int(_loaded().batchd_panel_width())


def tile_rows() -> int:
    """Rows :func:`product` computes in one pass over a panel (8 with 16-float vectors,
    6 with 8-float ones): a product of fewer rows costs about as much as a full tile."""
    return int(_loaded().batchd_tile_rows())


@dataclass(frozen=True)
class PackedWeight:
    """A weight laid out for :func:`product`: ``panels`` [count, k, width] and the bias
    in the same column order [count * width], or None. With ``swiglu`` each panel holds
    width / 2 columns of the gate and then the same columns of the up projection."""

    panels: np.ndarray
    bias: np.ndarray | None
    k: int
    n: int
    swiglu: bool


def _panels(columns: np.ndarray) -> np.ndarray:
    """[k, count * width] -> [count, k, width] (C order)."""
    k = columns.shape[0]
    width = panel_width()
    return np.ascontiguousarray(columns.reshape(k, -1, width).transpose(1, 0, 2))


def _pad_columns(w: np.ndarray, multiple: int) -> np.ndarray:
    extra = -w.shape[-1] % multiple
    if not extra:
        return w
    return np.concatenate([w, np.zeros((*w.shape[:-1], extra), dtype=w.dtype)], axis=-1)


def pack(weight: np.ndarray, bias: np.ndarray | None = None) -> PackedWeight:
    """Pack ``weight`` [k, n] (``x @ weight``) and its optional bias [n]."""
    k, n = weight.shape
    width = panel_width()
    columns = _pad_columns(np.asarray(weight, dtype=np.float32), width)
    packed_bias = None
    if bias is not None:
        packed_bias = np.ascontiguousarray(_pad_columns(np.asarray(bias, np.float32), width))
    return PackedWeight(_panels(columns), packed_bias, k, n, swiglu=False)


def pack_swiglu(
    gate: np.ndarray, up: np.ndarray, biases: tuple[np.ndarray, np.ndarray] | None = None
) -> PackedWeight:
    """Pack SwiGLU's ``gate`` and ``up`` [k, n] (and their optional biases) together."""
    if gate.shape != up.shape:
        raise KernelError(f"gate {gate.shape} and up {up.shape} differ in shape")
    k, n = gate.shape
    half = panel_width() // 2

    def interleave(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        g, u = (
            _pad_columns(np.asarray(g, np.float32), half),
            _pad_columns(np.asarray(u, np.float32), half),
        )
        rows = g.shape[:-1]
        both = np.stack([g.reshape(*rows, -1, half), u.reshape(*rows, -1, half)], axis=-2)
        return both.reshape(*rows, -1)

    bias = None if biases is None else np.ascontiguousarray(interleave(*biases))
    return PackedWeight(_panels(interleave(gate, up)), bias, k, n, swiglu=True)


def product(
    x: np.ndarray, weight: PackedWeight, *, threads: int, out: np.ndarray | None = None
) -> np.ndarray:
    """``x @ weight`` (+ bias), or silu(x @ gate) * (x @ up) for a SwiGLU pack, for x
    [m, k] float32 -> [m, n]; written into ``out`` when given (a C-contiguous float32
    [m, n] buffer: the view of an MLX array, so the result needs no copy into MLX)."""
    library = _loaded()
    _check_float32("x", x, 2)
    if x.shape[1] != weight.k:
        raise KernelError(f"x has {x.shape[1]} columns, the weight {weight.k} rows")
    if out is None:
        out = np.empty((x.shape[0], weight.n), dtype=np.float32)
    elif out.shape != (x.shape[0], weight.n) or not out.flags.c_contiguous:
        raise KernelError(f"out {out.shape} is not a contiguous [{x.shape[0]}, {weight.n}]")
    _check_float32("out", out, 2)
    status = library.batchd_product(
        x.ctypes.data,
        x.shape[0],
        weight.k,
        weight.panels.ctypes.data,
        None if weight.bias is None else weight.bias.ctypes.data,
        weight.n,
        out.ctypes.data,
        int(weight.swiglu),
        threads,
    )
    if status != 0:
        raise KernelError(f"product failed ({status}): x {x.shape}, weight {weight.k}x{weight.n}")
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of x [rows, dim] with ``weight`` [dim]."""
    library = _loaded()
    _check_float32("x", x, 2)
    _check_float32("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise KernelError(f"x has {x.shape[1]} columns, the norm's weight {weight.shape[0]}")
    out = np.empty_like(x)
    library.batchd_rms_norm(
        x.ctypes.data, weight.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], eps
    )
    return out


def rope_store(
    qkv: np.ndarray,
    table: np.ndarray,
    *,
    heads: int,
    kv_heads: int,
    traditional: bool,
    norms: tuple[np.ndarray, np.ndarray, float] | None,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    slots: np.ndarray,
) -> np.ndarray:
    """Split ``qkv`` [n, (heads + 2 kv_heads) * dim] into its queries, returned normed
    (``norms``: the q and k RMSNorm weights and eps, qwen3) and rotated by ``table``
    [n, dim] as [n, heads, dim], and its keys (normed, rotated) and values, written into
    the pools [kv_heads, pool slots, dim] at ``slots`` [n]."""
    library = _loaded()
    _check_float32("qkv", qkv, 2)
    _check_float32("table", table, 2)
    n, dim = table.shape
    if qkv.shape != (n, (heads + 2 * kv_heads) * dim):
        raise KernelError(f"qkv {qkv.shape} does not hold {heads}+2x{kv_heads} heads of {dim}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        _check_float32(name, pool, 3)
        if pool.shape[0] != kv_heads or pool.shape[2] != dim or not pool.flags.writeable:
            raise KernelError(
                f"{name}: needs a writable [{kv_heads}, slots, {dim}], got {pool.shape}"
            )
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    out = np.empty((n, heads, dim), dtype=np.float32)
    q_norm, k_norm, eps = (None, None, 0.0) if norms is None else norms
    status = library.batchd_rope_store(
        qkv.ctypes.data,
        n,
        heads,
        kv_heads,
        dim,
        table.ctypes.data,
        int(traditional),
        None if q_norm is None else q_norm.ctypes.data,
        None if k_norm is None else k_norm.ctypes.data,
        eps,
        out.ctypes.data,
        k_pool.ctypes.data,
        v_pool.ctypes.data,
        k_pool.shape[1],
        slots.ctypes.data,
    )
    if status != 0:
        raise KernelError(
            f"rope_store failed ({status}): {n} rows of dim {dim}, slots "
            f"{slots.min() if slots.size else None}..{slots.max() if slots.size else None} "
            f"of {k_pool.shape[1]}"
        )
    return out
