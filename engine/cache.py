"""Where the engine keeps what it can rebuild: converted and generated models, built kernels.

One folder, chosen the same way in every process so that every command works from any
directory and a model converted once is found again:

1. ``$BATCHD_HOME`` when set (everything batchd keeps goes under it);
2. ``$CACHE_DIRECTORY`` when systemd runs the daemon with ``CacheDirectory=batchd``
   (the shipped units do: ``/var/cache/batchd`` under ``ProtectSystem=strict``);
3. the platform's cache directory (platformdirs): ``~/.cache/batchd`` on Linux
   (``$XDG_CACHE_HOME`` honoured), ``~/Library/Caches/batchd`` on macOS.

The producers' state (the gateway's files) follows the same first rule in
:mod:`batchd.config.paths`; the engine imports nothing of batchd's, so the rule is
written in both and a test holds them to it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "BATCHD_HOME"
SYSTEMD_CACHE_ENV = "CACHE_DIRECTORY"


def cache_home() -> Path:
    """The folder batchd's rebuildable files go under (not created here)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser().absolute()
    systemd = os.environ.get(SYSTEMD_CACHE_ENV)
    if systemd:
        # systemd lists one folder per CacheDirectory= entry, separated by ':'.
        return Path(systemd.split(":")[0])
    return platformdirs.user_cache_path("batchd")


def model_cache() -> Path:
    """Where presets are built and GGUF files converted (``<cache home>/models``)."""
    return cache_home() / "models"


def kernel_cache() -> Path:
    """Where the C kernels are compiled (``<cache home>/kernels``)."""
    return cache_home() / "kernels"
