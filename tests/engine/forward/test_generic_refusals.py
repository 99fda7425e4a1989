"""What the generic path refuses, and how: the missing feature named, before any step."""

from __future__ import annotations

from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import pytest

from batchd.engine.exceptions import UnsupportedModelError
from batchd.engine.models.arch_fixture import build_model
from batchd.engine.models.loader import generic_spec


def test_recurrent_state_layers_are_refused() -> None:
    config = {
        "model_type": "mamba",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "state_size": 4,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": True,
    }
    model = build_model(config)
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 1\] keep state of type .*Cache"):
        generic_spec(model, config, source="m")


class _Layer(nn.Module):
    def __init__(self, owns_kv: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.owns_kv = owns_kv

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        if self.owns_kv:
            kv = self.proj(x)[:, None]
            cache.update_and_fetch(kv, kv)
        return x


class _SharedKV(nn.Module):
    """Layer 1 reads layer 0's K/V (as gemma3n's last layers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = [_Layer(True), _Layer(False)]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        x = self.embed(tokens)
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, c)
        return x


def test_layers_without_their_own_kv_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"layers \[1\] store no K/V of their own"):
        generic_spec(_SharedKV(), {"model_type": "x"}, source="m")
