"""batchd: a Redis-streams worker daemon for LLM generation on MLX.

The producer's surface is here: ``from batchd import Client, AsyncClient``. The parts
live below: :mod:`batchd.producers` (client SDK, CLI, gateway, bulk queues; no MLX),
:mod:`batchd.daemon` (the worker), :mod:`batchd.engine` (the inference library),
:mod:`batchd.config` (settings). Names resolve on first use, so ``import batchd`` loads
neither Redis's client nor MLX.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchd.producers.aio import AsyncClient
    from batchd.producers.client import Client

try:
    __version__ = version("batchd")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_PUBLIC = {
    "Client": "batchd.producers.client",
    "AsyncClient": "batchd.producers.aio",
}

__all__ = ["AsyncClient", "Client", "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'batchd' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
