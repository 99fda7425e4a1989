"""What ``serve`` and ``make-model`` say when a model cannot be loaded or converted.

The loaders' own messages describe where they stopped, not what the user gave: a path
that does not exist reaches the Hugging Face Hub client as a malformed repo id, an offline
hub id ends in a paragraph about snapshot folders.
:func:`explain` names what ``--model`` was taken for and what to give instead.
"""

from __future__ import annotations

from pathlib import Path

# What a model load or GGUF conversion raises for a bad input (GGUFError is a ValueError).
LOAD_FAILURES: tuple[type[Exception], ...] = (OSError, ValueError)
_WHAT = "give a model folder, a .gguf file, a preset (batchd make-model --help) or a hub id"


def explain(model: str, exc: Exception) -> str:
    """One paragraph for ``exc``, raised loading ``--model model``."""
    path = Path(model).expanduser()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not path.exists() and _looks_like_path(model):
        return f"{model} does not exist: {_WHAT} (org/name)"
    if path.is_dir() and not (path / "config.json").is_file():
        return (
            f"{model} is a folder but not a model: it has no config.json (a model folder holds "
            "config.json, *.safetensors weights and the tokenizer's files; batchd make-model "
            "writes one)"
        )
    if not path.exists() and _from_hub(exc):
        return (
            f"{model} was taken for a Hugging Face Hub id, but it could not be downloaded and is "
            f"not in the local cache ({first}): check the network and the id, or copy the model "
            "folder to this machine and give its path"
        )
    return first if model in first else f"{model}: {first}"


def _looks_like_path(model: str) -> bool:
    """Whether ``model`` was meant as a file or folder rather than a hub id (org/name)."""
    return model.startswith(("/", ".", "~")) or model.lower().endswith(".gguf") or "\\" in model


def _from_hub(exc: Exception) -> bool:
    """Whether ``exc`` comes from the Hugging Face Hub client (download or cache lookup)."""
    return any(cls.__module__.startswith("huggingface_hub") for cls in type(exc).__mro__)
