"""Import this before ``mlx``: on Linux it loads OpenBLAS so MLX's CPU products use it.

The engine's modules that import MLX (and the daemon's) import this module first, in an
import section of its own that sorts before third-party imports (``pyproject.toml``,
ruff's isort sections), so the order cannot be lost to a reformat. It is a module, not
the package's ``__init__``, so that importing the engine's pure-Python parts (its
options, the scheduler) loads no BLAS and changes no environment variable: a producer
that reads the settings stays free of both (see :mod:`batchd.engine.blas`).
"""

from __future__ import annotations

from batchd.engine.blas import preload_openblas

preload_openblas()
