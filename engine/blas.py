"""Make MLX use OpenBLAS on Linux CPU.

The ``mlx[cpu]`` wheel links a reference BLAS whose matrix products run about
50x slower than OpenBLAS on the same cores. Loading OpenBLAS into the global
symbol namespace before ``mlx.core`` is imported makes MLX resolve its BLAS
calls there. This must run before anything imports mlx, which is why
``engine/__init__.py`` calls it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHD_NO_OPENBLAS"
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


def preload_openblas() -> str | None:
    """Load OpenBLAS with RTLD_GLOBAL on Linux; return the library loaded, if any.

    Safe to call many times. Does nothing on macOS (MLX uses Accelerate and
    Metal there) or when ``BATCHD_NO_OPENBLAS=1``.
    """
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    if os.environ.get(DISABLE_ENV) == "1":
        log.info("OpenBLAS preload disabled by %s=1; MLX uses its bundled BLAS", DISABLE_ENV)
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before engine: OpenBLAS preload comes too late")
    found = ctypes.util.find_library("openblas")
    for name in (found, *_CANDIDATES):
        if not name:
            continue
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = name
        log.info("MLX will use OpenBLAS (%s) for CPU matrix products", name)
        return name
    log.warning("no OpenBLAS found: MLX falls back to its reference BLAS; %s", INSTALL_HINT)
    return None


def loaded_openblas() -> str | None:
    """The OpenBLAS library preloaded by this process, or None."""
    return _loaded
