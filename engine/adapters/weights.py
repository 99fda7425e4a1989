"""One LoRA adapter's weights, read from mlx-lm's adapter directory or PEFT's.

mlx-lm (``mlx_lm.lora`` writes it): ``adapter_config.json`` with ``fine_tune_type``
(``lora``) and ``lora_parameters.scale``, and ``adapters.safetensors`` holding
``<module path>.lora_a`` [in, rank] and ``<module path>.lora_b`` [rank, out]. The
layer computes ``y = x @ W.T + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)``.

PEFT (Hugging Face): ``adapter_config.json`` with ``peft_type`` ``LORA``, ``r`` and
``lora_alpha``, and ``adapter_model.safetensors`` holding
``base_model.model.<module path>.lora_A.weight`` [rank, in] and ``lora_B.weight``
[out, rank]: the same product with the matrices transposed and ``scale = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA). Module paths of Hugging Face llama-family
checkpoints are mlx-lm's.

Only the plain low-rank form is read: DoRA, full fine-tunes, per-layer ranks or
alphas and extra trained modules are refused with :class:`AdapterError` naming
what was found, never silently served as something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.exceptions import EngineError

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class AdapterError(EngineError, ValueError):
    """An adapter's files cannot be read, or describe something other than plain LoRA."""


@dataclass(frozen=True)
class LoRAPair:
    """The low-rank factors of one linear layer: ``a`` [in, rank], ``b`` [rank, out]."""

    a: mx.array
    b: mx.array

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])

    @cached_property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """``a`` and ``b`` as float32 NumPy arrays, for the packed C path."""
        return np.array(self.a.astype(mx.float32)), np.array(self.b.astype(mx.float32))


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter: its factors by module path (``model.layers.3.self_attn.q_proj``) and
    the scale its delta is multiplied by."""

    name: str
    path: Path
    scale: float
    layers: dict[str, LoRAPair]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.layers.values())


def load_adapter(name: str, path: str | Path) -> LoRAWeights:
    """Read the adapter directory ``path`` (mlx-lm's format, else PEFT's); the arrays are
    evaluated here, so a broken file fails now, not in a forward."""
    folder = Path(path).expanduser()
    config_file = folder / CONFIG
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} is not a JSON object")
    if (folder / MLX_WEIGHTS).exists():
        scale, layers = _mlx_lm(name, config, _load(name, folder / MLX_WEIGHTS))
    elif (folder / PEFT_WEIGHTS).exists():
        scale, layers = _peft(name, config, _load(name, folder / PEFT_WEIGHTS))
    else:
        raise AdapterError(
            f"adapter {name!r}: {folder} has neither {MLX_WEIGHTS} nor {PEFT_WEIGHTS}"
        )
    if not layers:
        raise AdapterError(f"adapter {name!r}: {folder} holds no LoRA layers")
    mx.eval([(p.a, p.b) for p in layers.values()])
    return LoRAWeights(name, folder, scale, layers)


def _load(name: str, file: Path) -> dict[str, mx.array]:
    try:
        loaded: Any = mx.load(str(file))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {file}: {exc}") from exc
    return dict(loaded)


def _mlx_lm(
    name: str, config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[float, dict[str, LoRAPair]]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"adapter {name!r}: fine_tune_type {kind!r}; only 'lora' is served")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), int | float):
        raise AdapterError(f"adapter {name!r}: {CONFIG} has no lora_parameters.scale")
    return float(params["scale"]), _pairs(name, weights, ".lora_a", ".lora_b", transposed=False)


def _peft(
    name: str, config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[float, dict[str, LoRAPair]]:
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise AdapterError(
            f"adapter {name!r}: a PEFT {config.get('peft_type')} adapter "
            f"(use_dora={config.get('use_dora')}); only plain LoRA is served"
        )
    for unsupported in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(unsupported):
            raise AdapterError(f"adapter {name!r}: PEFT {unsupported} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {name!r}: {CONFIG} needs r >= 1 and lora_alpha")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    unprefixed = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
    return float(scale), _pairs(
        name, unprefixed, ".lora_A.weight", ".lora_B.weight", transposed=True
    )


def _pairs(
    name: str, weights: dict[str, mx.array], a_suffix: str, b_suffix: str, *, transposed: bool
) -> dict[str, LoRAPair]:
    """Factors by module path; every tensor must be one half of a pair of matching rank."""
    pairs: dict[str, LoRAPair] = {}
    for key in weights:
        if not key.endswith((a_suffix, b_suffix)):
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA factor")
    for key, a in weights.items():
        if not key.endswith(a_suffix):
            continue
        path = key.removesuffix(a_suffix)
        b = weights.get(path + b_suffix)
        if b is None:
            raise AdapterError(f"adapter {name!r}: {key!r} has no {b_suffix!r} partner")
        if transposed:
            a, b = a.T, b.T
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(
                f"adapter {name!r}: {path} factors of shapes {a.shape} and {b.shape} "
                "do not multiply ([in, rank] @ [rank, out])"
            )
        pairs[path] = LoRAPair(a, b)
    orphans = [k for k in weights if k.endswith(b_suffix) and k.removesuffix(b_suffix) not in pairs]
    if orphans:
        raise AdapterError(f"adapter {name!r}: {orphans[0]!r} has no {a_suffix!r} partner")
    return pairs
