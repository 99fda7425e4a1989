"""The adapters an engine serves: registered by name, a bounded number resident, LRU.

Registered adapters are read once when registered (so a broken file fails at
start, naming the adapter), and the first ``max_resident`` stay loaded. A request
naming one that is not resident loads it again, evicting the least recently used
resident adapter that no live request names: an adapter in use is never evicted,
so while more distinct adapters are in use than ``max_resident`` the cache holds
them all (over its bound) and shrinks back as they finish.

A step's rows are handed to the model's adapted layers by :meth:`AdapterCache.serving`.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.adapters.layers import RowGroup, Switchboard, install
from batchd.engine.adapters.weights import AdapterError, LoRAWeights, load_adapter
from batchd.engine.config import ADAPTER_NAME
from batchd.engine.exceptions import InvalidRequest

log = logging.getLogger(__name__)

# (adapter name or None for the base model, first row, number of rows) of one chunk
Span = tuple[str | None, int, int]


def chunk_adapter(chunk: object) -> str | None:
    """The adapter a runner's chunk names (ScheduledChunk.adapter); None: the base model.
    Chunks built without one (tests' own) run on the base model."""
    name = getattr(chunk, "adapter", None)
    return name if isinstance(name, str) else None


class AdapterCache:
    """Registered adapters of one model and the resident ones (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_resident: int,
        in_use: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        if max_resident < 1:
            raise ValueError(f"max_resident={max_resident} must be >= 1")
        self.model = model
        self.max_resident = max_resident
        self.in_use = in_use
        self.board = Switchboard()
        self.paths: dict[str, Path] = {}
        self._resident: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recent first
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def resident(self) -> list[str]:
        """Names of the loaded adapters, least recently used first."""
        return list(self._resident)

    def register(self, name: str, path: str | Path) -> None:
        """Serve the adapter at ``path`` as ``name``; read now (AdapterError if it cannot
        be served on this model), kept resident while the cache has room."""
        if not re.fullmatch(ADAPTER_NAME, name):
            raise AdapterError(f"adapter name {name!r} must match {ADAPTER_NAME}")
        if name in self.paths:
            raise AdapterError(f"adapter {name!r} is registered twice")
        weights = self._load(name, Path(path))
        self.paths[name] = weights.path
        if len(self._resident) < self.max_resident:
            self._resident[name] = weights

    def acquire(self, name: str, request_id: str) -> None:
        """Make ``name`` resident for a request about to run with it, and shrink the cache
        back to its bound where adapters no longer in use allow; InvalidRequest if
        ``name`` is not registered."""
        if name not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none"
            raise InvalidRequest(
                f"request {request_id!r}: adapter {name!r} is not served (served: {known})"
            )
        self.get(name)
        self._shrink(keep=name, room=0)

    def get(self, name: str) -> LoRAWeights:
        """The weights of registered adapter ``name``, loading them if evicted."""
        weights = self._resident.get(name)
        if weights is not None:
            self._resident.move_to_end(name)
            return weights
        self._shrink(keep=name, room=1)
        weights = self._resident[name] = self._load(name, self.paths[name])
        if len(self._resident) > self.max_resident:
            log.warning(
                "adapter cache over its bound of %d: %d adapters in use",
                self.max_resident,
                len(self._resident),
            )
        return weights

    def serving(self, spans: Sequence[Span]) -> AbstractContextManager[None] | None:
        """Apply each span's adapter to its rows in the graphs built inside the returned
        context; None when no span names an adapter (the base model alone)."""
        named = {a for a, _, _ in spans if a is not None}
        if not named:
            return None
        if len(named) == 1 and all(a is not None for a, _, _ in spans):
            # Every real row: the delta on the whole input (padding rows are dropped later).
            return self.board.serving((RowGroup(self.get(named.pop()), None),))
        rows: dict[str, list[np.ndarray]] = {}
        for adapter, first, count in spans:
            if adapter is not None:
                rows.setdefault(adapter, []).append(np.arange(first, first + count))
        groups = tuple(
            RowGroup(self.get(a), mx.array(np.concatenate(r).astype(np.int32)))
            for a, r in rows.items()
        )
        return self.board.serving(groups)

    def _load(self, name: str, path: Path) -> LoRAWeights:
        weights = load_adapter(name, path)
        outside = [p for p in weights.layers if ".layers." not in f".{p}"]
        if outside:
            raise AdapterError(
                f"adapter {name!r}: {outside[0]} is outside the transformer layers "
                "(only their linear layers are adapted)"
            )
        install(self.model, weights, self.board)
        self.num_loads += 1
        log.info(
            "adapter %s loaded from %s: %d layers, %.1f MiB",
            name,
            weights.path,
            len(weights.layers),
            weights.nbytes / 2**20,
        )
        return weights

    def _shrink(self, *, keep: str, room: int) -> None:
        """Evict least recently used adapters that no live request names (nor ``keep``)
        until ``room`` more fit within the bound."""
        busy = {*self.in_use(), keep}
        for name in list(self._resident):
            if len(self._resident) + room <= self.max_resident:
                return
            if name not in busy:
                del self._resident[name]
                self.num_evictions += 1
