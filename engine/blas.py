"""Make MLX use OpenBLAS on Linux CPU.

The ``mlx[cpu]`` wheel links a reference BLAS whose matrix products run far
slower than OpenBLAS on the same cores (docs/bench/HISTORY.md). Loading OpenBLAS into the global
symbol namespace before ``mlx.core`` is imported makes MLX resolve its BLAS
calls there. This must run before anything imports mlx, which is why
``engine/__init__.py`` calls it first.

OpenBLAS picks its kernels from the CPU model at load time, and a build older
than the CPU falls back to its SSE3 "Prescott" kernels, several times slower
than the AVX-512 "SkylakeX" kernels it ships. So where the CPU reports the
AVX-512 subsets those kernels use and the user has not chosen
(``OPENBLAS_CORETYPE``), the preload asks for them.

Except on AMD's Zen 4 (family 25 with AVX-512), which runs each 512-bit
instruction as two 256-bit halves: there the AVX2 "Haswell" kernels multiply
large matrices as fast and the products of decode size faster. Zen 5 (family
26) has full-width AVX-512 units and keeps SkylakeX. Revisit the family list
when a new CPU family appears, or when an OpenBLAS release picks kernels for
Zen 4 itself.

OpenBLAS's worker threads spin, yielding, for 2**28 cycles after each product
before they sleep, so between two products they never sleep: while the
engine's own attention kernel or MLX's other operations run, a spinning
worker takes a core from them. Unless the user set ``OPENBLAS_THREAD_TIMEOUT``,
the preload sets it to its least, 4 (2**4 cycles): the workers sleep at once
and are woken for the next product. Revisit both choices if the engine's CPU
path goes back to OpenBLAS's products (they serve the MLX path and the
benchmark's peers now). The measurements behind them are in the measurement
log (docs/bench/HISTORY.md, "Figures behind the code's choices").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHD_NO_OPENBLAS"
CORETYPE_ENV = "OPENBLAS_CORETYPE"
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
# log2 of the cycles OpenBLAS's idle workers spin before sleeping: its least accepted value.
THREAD_TIMEOUT = "4"
# The instruction subsets OpenBLAS's SkylakeX kernels (and its own CPU check for them) use.
SKYLAKEX_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
# AMD families whose AVX-512 units are 256 bits wide: AVX2 kernels are faster there.
HALF_WIDTH_AVX512_AMD_FAMILIES = frozenset({25})
# OpenBLAS's fallback kernels when it does not know the CPU model.
FALLBACK_CORES = frozenset({"prescott", "core2", "nehalem"})
_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.3.so",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
INSTALL_HINT = (
    "install OpenBLAS for ~50x faster matrix products on CPU "
    "(Debian/Ubuntu: apt-get install libopenblas0-pthread; Fedora: dnf install openblas)"
)

_loaded: str | None = None
_core: str | None = None


def preload_openblas() -> str | None:
    """Load OpenBLAS with RTLD_GLOBAL on Linux; return the library loaded, if any.

    Safe to call many times. Does nothing on macOS (MLX uses Accelerate and
    Metal there) or when ``BATCHD_NO_OPENBLAS=1``.
    """
    global _loaded, _core
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    if os.environ.get(DISABLE_ENV) == "1":
        log.info("OpenBLAS preload disabled by %s=1; MLX uses its bundled BLAS", DISABLE_ENV)
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before engine: OpenBLAS preload comes too late")
    flags = cpu_flags()
    if CORETYPE_ENV not in os.environ and (core := kernel_choice(flags, cpu_model())) is not None:
        os.environ[CORETYPE_ENV] = core
    os.environ.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT)
    found = ctypes.util.find_library("openblas")
    for name in (found, *_CANDIDATES):
        if not name:
            continue
        try:
            library = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = name
        _core = core = _core_name(library)
        log.info("MLX will use OpenBLAS (%s, %s kernels) for CPU matrix products", name, core)
        if core.lower() in FALLBACK_CORES and "avx2" in flags:
            log.warning(
                "OpenBLAS does not know this CPU and runs its %s kernels, several times "
                "slower than the CPU allows: set %s (e.g. Haswell or SkylakeX)",
                core,
                CORETYPE_ENV,
            )
        return name
    log.warning("no OpenBLAS found: MLX falls back to its reference BLAS; %s", INSTALL_HINT)
    return None


@functools.cache
def _first_cpu() -> dict[str, str]:
    """The fields /proc/cpuinfo lists for the first CPU (empty elsewhere); read once."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU (empty elsewhere)."""
    return frozenset(_first_cpu().get("flags", "").split())


def cpu_model() -> tuple[str, int]:
    """The first CPU's vendor id and family number (``("", 0)`` where unknown)."""
    fields = _first_cpu()
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


def cpu_description() -> str:
    """The first CPU's model name, vendor and family, for reports ("" where unknown)."""
    fields = _first_cpu()
    vendor, family = cpu_model()
    name = fields.get("model name", "")
    return f"{name} ({vendor} family {family})" if vendor else name


def kernel_choice(flags: frozenset[str], model: tuple[str, int] = ("", 0)) -> str | None:
    """The OpenBLAS core type to ask for, or None to leave it to OpenBLAS's own detection.

    ``model`` is the CPU's (vendor id, family), as :func:`cpu_model` reads them.
    """
    if not SKYLAKEX_FLAGS <= flags:
        return None
    vendor, family = model
    if vendor == "AuthenticAMD" and family in HALF_WIDTH_AVX512_AMD_FAMILIES:
        return "Haswell"
    return "SkylakeX"


def _core_name(library: ctypes.CDLL) -> str:
    try:
        get = library.openblas_get_corename
    except AttributeError:
        return "unknown"
    get.restype = ctypes.c_char_p
    return (get() or b"unknown").decode()


def loaded_openblas() -> str | None:
    """The OpenBLAS library preloaded by this process, or None."""
    return _loaded


def loaded_core() -> str | None:
    """The kernels the preloaded OpenBLAS runs (e.g. ``SkylakeX``), or None."""
    return _core
