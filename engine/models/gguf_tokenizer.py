"""A Hugging Face tokenizer rebuilt from the vocabulary a GGUF file carries.

GGUF stores the whole tokenizer as metadata (tokens, merges, token types,
bos/eos ids, chat template). For byte-level BPE (``tokenizer.ggml.model =
gpt2``, the family of Llama 3, SmolLM, Qwen) that is enough to write a
``tokenizer.json`` and ``tokenizer_config.json`` that ``mlx_lm.load``
reads like a downloaded model's. The pre-tokenizer is not stored, only its
name (``tokenizer.ggml.pre``), so the known names map to their split rules
and unknown ones are refused rather than tokenized subtly wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchd.engine.models.gguf_header import GGUFError, meta_value

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how llama.cpp splits text before BPE.
_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "qwen2": "qwen2",
}


def _pre_tokenizer(name: str, *, source: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    kind = _PRE_TOKENIZERS.get(name)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind != "llama3")
    if kind == "gpt2":
        return byte_level
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("llama3", "qwen2"):
        split = pre_tokenizers.Split(
            Regex(_LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT),
            behavior="isolated",
            invert=False,
        )
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    raise GGUFError(
        f"{source}: tokenizer pre-tokenizer {name!r} is not known; known: "
        f"{', '.join(sorted(_PRE_TOKENIZERS))}"
    )


def write_tokenizer(metadata: dict[str, Any], out_dir: Path, *, source: str) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; return bos/eos ids.

    Raises GGUFError for tokenizers other than byte-level BPE.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta_value(metadata, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported; only byte-level "
            "BPE ('gpt2': Llama 3, SmolLM, Qwen) tokenizers convert"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"].tolist()]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    pre = meta_value(metadata, "tokenizer.ggml.pre", "default")
    tok.pre_tokenizer = _pre_tokenizer(pre, source=source)
    tok.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    )
    bos_id = meta_value(metadata, "tokenizer.ggml.bos_token_id")
    eos_id = meta_value(metadata, "tokenizer.ggml.eos_token_id")
    add_bos = bool(meta_value(metadata, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    tok.save(str(out_dir / "tokenizer.json"))
    pad_id = meta_value(metadata, "tokenizer.ggml.padding_token_id")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_id],
        "pad_token": tokens[pad_id] if pad_id is not None else None,
        "unk_token": None,
        "add_bos_token": add_bos,
        "model_max_length": int(meta_value(metadata, f"{_arch(metadata)}.context_length", 1 << 20)),
        "clean_up_tokenization_spaces": False,
    }
    template = meta_value(metadata, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {"eos_token_id": int(eos_id)}
    if bos_id is not None:
        ids["bos_token_id"] = int(bos_id)
    return ids


def _arch(metadata: dict[str, Any]) -> str:
    return str(meta_value(metadata, "general.architecture", "llama"))
