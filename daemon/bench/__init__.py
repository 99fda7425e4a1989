"""``batchd bench``: batchd's engine against its peers, side by side, in one run.

Every figure is a ratio measured in the same process on the same model and
the same seeded requests: absolute times on a shared machine drift by tens
of percent within minutes, so only ratios taken side by side mean anything
(docs/performance.md).
"""

# Preloads OpenBLAS before any submodule imports mlx (MLX's CPU products need it).
import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)
