"""Convert a GGUF file into an mlx-lm model directory, through llama.cpp's ``gguf`` package.

GGUF is how most local models are held (llama.cpp, Ollama, LM Studio); mlx-lm
does not load it. The file is read with ``gguf.GGUFReader`` (memory-mapped)
and every tensor type ``gguf.quants`` can dequantize is accepted: F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants (Q2_K to Q6_K), the IQ types,
TQ1_0/TQ2_0, MXFP4, NVFP4. Weights become float32, except with
``keep_quantized``: Q4_0, Q4_1 and Q8_0 tensors are exactly MLX affine
quantizations (group 32, 4 or 8 bits) and are kept as such, repacked; every
other type is dequantized still (MLX has no equivalent of its block formats).
Architectures and their fixes: batchd.engine.models.gguf_arch; tokenizers:
batchd.engine.models.gguf_tokenizer.

Every problem of a file (tensor types, architecture, metadata, tensor names,
tokenizer) is collected and reported at once, before anything is written.

MLX's quantized matmul on CPU is single-threaded while float32 uses
OpenBLAS, so on a machine without a GPU the default is float32; on Metal
quantized tensors are kept; on CUDA they are not (see keeps_quantized).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.models.gguf_arch import ARCHES, TOP_NAMES, Arch, Problems, llama3_rope_scaling
from batchd.engine.models.gguf_header import GGUFError, tensor_types
from batchd.engine.models.gguf_tokenizer import write_tokenizer

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # Q4_0, Q4_1 and Q8_0 blocks hold 32 weights
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Rope tensors that become config, not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_TOP = re.compile(r"(\w+)\.(weight|bias)$")


def keeps_quantized() -> bool:
    """Whether a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized by default here: on Metal,
    where MLX's quantized products are the fast path. Not on a CPU (they run on one
    thread), nor on CUDA, where MLX builds a CUTLASS kernel with NVRTC the first time a
    quantized product meets each tile of rows, tens of seconds each, and a continuous
    batch's row counts keep meeting new tiles (docs/bench/HISTORY.md, "Figures behind
    the code's choices")."""
    return bool(mx.metal.is_available())


def dequantizable_types() -> tuple[str, ...]:
    """The ggml types this installation converts: what ``gguf.quants`` dequantizes."""
    from gguf import quants

    return ("F32", "F16", *(t.name for t in quants._type_traits))


def _hf_name(name: str, arch: Arch) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor, or None if it has none."""
    if m := _BLOCK.match(name):
        layer, part, leaf = m.groups()
        if part in arch.layer_names:
            return f"model.layers.{layer}.{arch.layer_names[part]}.{leaf}"
    elif (m := _TOP.match(name)) and m.group(1) in TOP_NAMES:
        return f"{TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (lists for arrays)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _check(reader: Any, metadata: dict[str, Any], source: str) -> tuple[Arch | None, Problems]:
    problems = Problems()
    name = metadata.get("general.architecture")
    arch = ARCHES.get(str(name))
    if arch is None:
        problems.add(
            f"architecture {name!r} is not supported; GGUF import takes "
            f"{', '.join(sorted(ARCHES))} (convert other models from their Hugging Face "
            "checkpoint with mlx_lm.convert, which the engine loads directly)"
        )
    known = dequantizable_types()
    bad: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in known:
            bad.setdefault(kind, []).append(tensor.name)
    for kind, names in bad.items():
        problems.add(
            f"tensor type {kind} ({len(names)} tensors, e.g. {names[0]}) cannot be "
            f"dequantized by the gguf package; supported: {', '.join(known)}. Download "
            "another quantization of the model (Q4_K_M and Q8_0 are common)"
        )
    if arch is not None:
        unknown = [
            t.name
            for t in reader.tensors
            if t.name not in _ROPE_TENSORS and _hf_name(t.name, arch) is None
        ]
        if unknown:
            problems.add(
                f"{len(unknown)} tensors have no {arch.model_type} counterpart (e.g. "
                f"{', '.join(unknown[:3])}): not a plain {name} model"
            )
        factors = [t.name for t in reader.tensors if t.name.startswith("rope_factors")]
        if factors and arch.model_type != "phi3":
            problems.add(
                f"long-context rope factors ({', '.join(factors)}) are supported for phi3 "
                f"only, not {name}; convert from the Hugging Face checkpoint (mlx_lm.convert)"
            )
        elif factors and "rope_factors_long.weight" not in factors:
            problems.add(f"{', '.join(factors)} without rope_factors_long.weight")
    return arch, problems


def _array(tensor: Any) -> np.ndarray:
    """A tensor dequantized to float32 in mlx-lm's (out, in) layout."""
    from gguf import quants

    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    if kind in ("F32", "F16"):
        return data.astype(np.float32)
    return np.asarray(quants.dequantize(data, tensor.tensor_type), dtype=np.float32)


def _kept(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """A Q4_0, Q4_1 or Q8_0 tensor as an exact MLX affine triple (weight as uint32,
    scales, biases) and its bits; None for other types."""
    kind = tensor.tensor_type.name
    if kind not in KEPT_TYPES:
        return None
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[:-1]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(*rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        packed = q.astype(np.uint8).reshape(*rows, -1).view(np.uint32)
        return packed, d, (-128 * d.astype(np.float32)).astype(np.float16), 8
    nibbles = blocks[..., 2:] if kind == "Q4_0" else blocks[..., 4:]
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # block order
    pairs = values.reshape(*rows, -1, 16, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    packed = packed.reshape(*rows, -1).view(np.uint32)
    if kind == "Q4_0":
        bias = (-8 * d.astype(np.float32)).astype(np.float16)
    else:
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return packed, d, bias, 4


def _weights(
    reader: Any, arch: Arch, *, keep_quantized: bool
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    weights: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name, arch)
        if hf is None:
            continue
        kept = _kept(tensor) if keep_quantized and hf.endswith(".weight") else None
        if kept is not None:
            packed, scales, biases, bits = kept
            module = hf.removesuffix(".weight")
            weights[hf] = mx.array(packed)
            weights[f"{module}.scales"] = mx.array(scales)
            weights[f"{module}.biases"] = mx.array(biases)
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
            continue
        array = _array(tensor)
        if arch.norm_offset and "norm" in hf:
            array = array - arch.norm_offset
        weights[hf] = mx.array(array)
    return weights, quantization


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, keep_quantized: bool | None = None
) -> Path:
    """Write an mlx-lm model directory converted from ``gguf_path``; returns it.

    ``keep_quantized=None`` keeps Q4_0/Q4_1/Q8_0 tensors quantized on Metal only
    (keeps_quantized). The directory is written beside ``out_dir`` and moved into place last,
    so an interrupted conversion never leaves a half model. Raises GGUFError (a
    ValueError) listing every problem of the file.
    """
    from gguf import GGUFReader

    source, out = str(gguf_path), Path(out_dir)
    tensor_types(gguf_path)  # a clear error for what is not a GGUF at all
    keep = keeps_quantized() if keep_quantized is None else keep_quantized
    reader = GGUFReader(source)
    metadata = read_metadata(reader)
    arch, problems = _check(reader, metadata, source)
    config: dict[str, Any] = {}
    if arch is not None:
        name = str(metadata["general.architecture"])
        config = {"model_type": arch.model_type, **arch.config(metadata, name, problems)}
        if arch.rope_traditional:
            config["rope_traditional"] = True
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            config["rope_scaling"] = llama3_rope_scaling(
                _array(freqs),
                head_dim=int(config["head_dim"]),
                theta=float(config["rope_theta"]),
                problems=problems,
            )
        factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors")}
        if "rope_factors_long.weight" in factors:
            config["rope_scaling"] = longrope_scaling(factors)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=_parent(out)) as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        config.update(write_tokenizer(metadata, work, source=source, problems=problems))
        if problems.lines:
            raise GGUFError(
                f"{source}: cannot convert ({len(problems.lines)} problems):\n"
                + "\n".join(f"- {line}" for line in problems.lines)
            )
        assert arch is not None
        weights, quantization = _weights(reader, arch, keep_quantized=keep)
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
        config["vocab_size"] = int(weights["model.embed_tokens.weight"].shape[0])
        if quantization:
            bits = max(q["bits"] for q in quantization.values())
            config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, **quantization}
        config["torch_dtype"] = "float32"
        mx.save_safetensors(str(work / "model.safetensors"), weights, metadata={"format": "mlx"})
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    log.info("converted %s to %s (%s)", source, out, "quantized" if quantization else "float32")
    return out


def longrope_scaling(factors: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 128k / Phi-4-mini's ``rope_scaling`` from llama.cpp's per-frequency factor
    tensors (the short factors default to the long ones when the file has only those)."""
    long = [float(x) for x in _array(factors["rope_factors_long.weight"]).reshape(-1)]
    short_tensor = factors.get("rope_factors_short.weight")
    short = long if short_tensor is None else [float(x) for x in _array(short_tensor).reshape(-1)]
    return {"type": "longrope", "long_factor": long, "short_factor": short}


def _parent(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent
