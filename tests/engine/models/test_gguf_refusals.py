"""What GGUF import refuses, and that the refusal names what is wrong.

The files are small GGUFs written here with ``mx.save_gguf``; an unsupported
tensor type is made by rewriting one tensor's type id in the header (MLX
cannot write K-quants).
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import pytest

from batchd.engine.models.gguf_convert import convert_gguf
from batchd.engine.models.gguf_header import GGUFError, tensor_types

TENSOR = "blk.0.attn_q.weight"
Q4_K = 12


def _write(path: Path, *, arch: str = "llama") -> Path:
    arrays = {TENSOR: mx.zeros((8, 32)), "output_norm.weight": mx.ones((32,))}
    metadata = {"general.architecture": arch, "llama.embedding_length": mx.array(32)}
    mx.save_gguf(str(path), arrays, metadata)
    return path


def _set_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite a tensor's ggml type id in place (name, n_dims, dims, then the type)."""
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def test_header_reader_lists_tensor_types(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    assert tensor_types(path) == {TENSOR: "F32", "output_norm.weight": "F32"}


def test_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "k.gguf")
    _set_type(path, TENSOR, Q4_K)
    assert tensor_types(path)[TENSOR] == "Q4_K"
    with pytest.raises(GGUFError, match=rf"tensor type Q4_K .*{TENSOR}.*Q4_0, Q4_1, Q8_0"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "g.gguf", arch="gemma2")
    with pytest.raises(GGUFError, match="architecture 'gemma2' is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(path, tmp_path / "out")
