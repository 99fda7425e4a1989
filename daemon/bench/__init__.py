"""``batchd bench``: batchd's engine against its peers, side by side, in one run.

Every figure is a ratio measured in the same process on the same model and
the same seeded requests (see BENCHMARK.md): absolute times on a shared
machine mean little, ratios taken minutes apart mean a lot.
"""

# Preloads OpenBLAS before any submodule imports mlx (50x faster CPU matmuls).
import engine  # noqa: F401
