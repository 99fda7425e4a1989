"""The bench-llama8b preset: Llama-3-8B's shape in bfloat16, for the GPU benchmark.

Its 16 GB of weights are never built here: its shape is checked on mlx-lm's model
class, whose initial weights stay lazy (no memory), and the registry's build path runs
on the same config shrunk to a few MB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from batchd.engine.models import presets
from batchd.engine.models.arch_fixture import arch_config
from batchd.engine.models.registry import ensure_preset

LLAMA3_8B_PARAMETERS = 8_030_261_248  # Meta-Llama-3-8B's safetensors, every tensor
SMALL = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
}


def preset_config() -> dict[str, Any]:
    shape = presets.ARCH_PRESETS["bench-llama8b"]
    return arch_config(shape["model_type"]) | shape  # as the registry builds it


def test_the_preset_is_llama3_8b_in_bfloat16(tmp_path: Path) -> None:
    from mlx_lm.utils import _get_classes

    from batchd.daemon.bench.limit import ModelFlops

    config = preset_config()
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 500000.0
    before = mx.get_active_memory()
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    assert model_class.__module__ == "mlx_lm.models.llama"
    assert sum(p.size for p in params.values()) == LLAMA3_8B_PARAMETERS
    assert mx.get_active_memory() - before < 1 << 20  # shapes only, nothing drawn
    # The bench's FLOPs per decoded token (attention aside): 2 x every matmul weight,
    # the output head included, the embedding table and the norms not.
    hidden, vocab, layers = 4096, 128256, 32
    matmul = LLAMA3_8B_PARAMETERS - vocab * hidden - (2 * layers + 1) * hidden
    assert params["lm_head.weight"].shape == (vocab, hidden)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelFlops.from_model_dir(tmp_path).per_output_token == 2 * matmul


def test_the_registry_builds_it_in_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preset's path through the registry, at a few MB: every weight drawn in
    bfloat16 at 1/sqrt(fan-in), a tokenizer of all 128256 ids, and both batchd's
    engine and mlx-lm load and run it."""
    small = presets.ARCH_PRESETS["bench-llama8b"] | SMALL
    monkeypatch.setitem(presets.ARCH_PRESETS, "bench-llama8b", small)
    path = ensure_preset("bench-llama8b", path=tmp_path / "llama8b")
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
    down = weights["model.layers.0.mlp.down_proj.weight"].astype(mx.float32)
    assert down.shape == (128, 256)
    assert abs(float(down.std()) * 256**0.5 - 1) < 0.05
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 128256

    from mlx_lm import load

    from batchd.engine import EngineConfig, LLMEngine, SamplingParams

    tokenizer = load(str(path))[1]
    assert isinstance(tokenizer.decode([128255, 128000, 70000, 16]), str)  # no id beyond it
    engine = LLMEngine.from_pretrained(path, EngineConfig())
    prompt = [16, 500, 70000, 128255]
    [out] = engine.generate([prompt], [SamplingParams(max_tokens=4, ignore_eos=True)])
    assert len(out) == 4 and all(0 <= t < 128256 for t in out)
