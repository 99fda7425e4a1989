"""The tensor table of a GGUF file, read before any weight is.

A pure-Python look at the header (the metadata is skipped, not decoded): it
tells a file that is not a GGUF at all from one the converter reads with the
``gguf`` package, and lists each tensor's type for messages and tools.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from batchd.engine.exceptions import UnsupportedModelError

# ggml_type ids (ggml.h), for messages.
GGML_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
}

# Byte sizes of the fixed-size metadata value types (gguf_type ids).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFError(UnsupportedModelError):
    """The file is not a GGUF batchd can convert; the message says why."""


def meta_value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python value (``mx.load`` gives scalars as 0-d arrays)."""
    value = metadata.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _u32(f: BinaryIO) -> int:
    value: int = struct.unpack("<I", _exactly(f, 4))[0]
    return value


def _u64(f: BinaryIO) -> int:
    value: int = struct.unpack("<Q", _exactly(f, 8))[0]
    return value


def _exactly(f: BinaryIO, size: int) -> bytes:
    """``size`` bytes of the header, or GGUFError naming the file: a file cut short (an
    interrupted download or copy) ends inside its header."""
    raw = f.read(size)
    if len(raw) != size:
        name = getattr(f, "name", "the GGUF file")
        why = "is truncated or corrupt (it ends inside its header): fetch it again"
        raise GGUFError(f"{name} {why}")
    return raw


def _string(f: BinaryIO) -> str:
    return f.read(_u64(f)).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        f.seek(_u64(f), 1)
    elif value_type == _ARRAY:
        item_type, count = _u32(f), _u64(f)
        if item_type in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item_type] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[value_type], 1)
    else:
        raise GGUFError(f"unknown GGUF metadata value type {value_type}")


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each tensor's name and ggml type name (e.g. ``Q4_K``), in file order."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic)")
        version = _u32(f)
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        n_tensors, n_kv = _u64(f), _u64(f)
        for _ in range(n_kv):
            _string(f)
            _skip_value(f, _u32(f))
        types: dict[str, str] = {}
        for _ in range(n_tensors):
            name = _string(f)
            n_dims = _u32(f)
            f.seek(8 * n_dims, 1)
            type_id = _u32(f)
            f.seek(8, 1)  # data offset
            types[name] = GGML_TYPES.get(type_id, f"type {type_id}")
    return types
