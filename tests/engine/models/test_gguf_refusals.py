"""What GGUF import refuses, and that the refusal names what is wrong.

The files are small GGUFs written here with ``mx.save_gguf``; the refusals of
tensor types, tokenizers and metadata, all listed at once, are in test_gguf_import.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from batchd.engine.models.gguf_convert import convert_gguf
from batchd.engine.models.gguf_header import GGUFError, tensor_types

TENSOR = "blk.0.attn_q.weight"


def _write(path: Path, *, arch: str = "llama") -> Path:
    arrays = {TENSOR: mx.zeros((8, 32)), "output_norm.weight": mx.ones((32,))}
    metadata = {"general.architecture": arch, "llama.embedding_length": mx.array(32)}
    mx.save_gguf(str(path), arrays, metadata)
    return path


def test_header_reader_lists_tensor_types(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    assert tensor_types(path) == {TENSOR: "F32", "output_norm.weight": "F32"}


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "g.gguf", arch="mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("kept", [6, 20, 60])
def test_a_file_cut_inside_its_header_is_refused_by_name(tmp_path: Path, kept: int) -> None:
    """An interrupted download: the header reader names the file as truncated (it raised
    struct.error, which no caller expects)."""
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:kept])
    with pytest.raises(GGUFError, match="truncated"):
        tensor_types(cut)
