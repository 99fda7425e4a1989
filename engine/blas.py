"""Make MLX use OpenBLAS on Linux CPU.

The ``mlx[cpu]`` wheel links a reference BLAS whose matrix products run about
50x slower than OpenBLAS on the same cores. Loading OpenBLAS into the global
symbol namespace before ``mlx.core`` is imported makes MLX resolve its BLAS
calls there. This must run before anything imports mlx, which is why
``engine/__init__.py`` calls it first.

OpenBLAS picks its kernels from the CPU model at load time, and a build older
than the CPU falls back to its SSE3 "Prescott" kernels: Debian 12's OpenBLAS
0.3.21 on a Sapphire Rapids Xeon (2 cores) multiplies float32 at 65 GFLOP/s
that way, against 300 with the AVX-512 "SkylakeX" kernels it ships. So where
the CPU reports the AVX-512 subsets those kernels use and the user has not
chosen (``OPENBLAS_CORETYPE``), the preload asks for them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHD_NO_OPENBLAS"
CORETYPE_ENV = "OPENBLAS_CORETYPE"
# The instruction subsets OpenBLAS's SkylakeX kernels (and its own CPU check for them) use.
SKYLAKEX_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
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
    if CORETYPE_ENV not in os.environ and (core := kernel_choice(flags)) is not None:
        os.environ[CORETYPE_ENV] = core
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


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def kernel_choice(flags: frozenset[str]) -> str | None:
    """The OpenBLAS core type to ask for, or None to leave it to OpenBLAS's own detection."""
    return "SkylakeX" if SKYLAKEX_FLAGS <= flags else None


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
