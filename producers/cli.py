"""Producer subcommands of ``batchd`` (placeholder until the producers land)."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    """Add the producer subcommands to the ``batchd`` parser."""
