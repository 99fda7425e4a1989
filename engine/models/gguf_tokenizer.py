"""A Hugging Face tokenizer rebuilt from the vocabulary a GGUF file carries.

GGUF stores the whole tokenizer as metadata (tokens, merges or scores, token
types, bos/eos ids, chat template), enough to write a ``tokenizer.json`` and
``tokenizer_config.json`` that ``mlx_lm.load`` reads like a downloaded model's.

- Byte-level BPE (``tokenizer.ggml.model = gpt2``: Llama 3, SmolLM, Qwen). The
  pre-tokenizer is not stored, only its name (``tokenizer.ggml.pre``), so the
  known names map to their split rules and unknown ones are refused rather
  than tokenized subtly wrong.
- SentencePiece BPE (``llama``: Gemma, Llama 2, Mistral, Phi-3), written as
  Hugging Face writes those tokenizers: spaces become ``▁``, byte-fallback
  tokens ``<0x..>``, and the merges are recovered from the vocabulary and its
  scores (a token's pieces merge with the priority of the token's score).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchd.engine.models.gguf_arch import Problems
from batchd.engine.models.gguf_header import meta_value

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Gemma's chat format (its tokenizer_config.json's template, system turn folded into the
# first user turn), for Gemma files that carry no template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + m['content']) | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
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


def _pre_tokenizer(name: str) -> Any:
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
    return None


def write_tokenizer(
    metadata: dict[str, Any], out_dir: Path, *, source: str, problems: Problems
) -> dict[str, int | list[int]]:
    """Write tokenizer.json and tokenizer_config.json; return bos/eos ids. What cannot
    be converted is added to ``problems`` (and nothing is written)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    model = meta_value(metadata, "tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        problems.add("the file carries no tokenizer (tokenizer.ggml.tokens)")
        return {}
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if model == "gpt2":
        pre = meta_value(metadata, "tokenizer.ggml.pre", "default")
        pre_tokenizer = _pre_tokenizer(pre)
        if pre_tokenizer is None:
            problems.add(
                f"tokenizer pre-tokenizer {pre!r} is not known; known: "
                f"{', '.join(sorted(_PRE_TOKENIZERS))}"
            )
            return {}
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        scores = [float(x) for x in metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        unk = meta_value(metadata, "tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_spm_merges(tokens, scores, types),
                unk_token=tokens[unk] if unk is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        # llama.cpp prepends a space unless the file says not to (Gemma's do).
        prefix = bool(meta_value(metadata, "tokenizer.ggml.add_space_prefix", True))
        replace = normalizers.Replace(" ", "\u2581")
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            steps.append(decoders.Strip(" ", 1, 0))
        else:
            tok.normalizer = replace
        tok.decoder = decoders.Sequence(steps)
    else:
        problems.add(
            f"tokenizer.ggml.model {model!r} is not supported; byte-level BPE ('gpt2': "
            "Llama 3, SmolLM, Qwen) and SentencePiece ('llama': Gemma, Llama 2, Mistral, "
            "Phi-3) convert"
        )
        return {}
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    )
    bos_id = meta_value(metadata, "tokenizer.ggml.bos_token_id")
    eos_id = meta_value(metadata, "tokenizer.ggml.eos_token_id")
    if eos_id is None:
        problems.add("metadata tokenizer.ggml.eos_token_id is missing")
        return {}
    add_bos = bool(meta_value(metadata, "tokenizer.ggml.add_bos_token", model == "llama"))
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
    gemma = _arch(metadata).startswith("gemma") and "<end_of_turn>" in vocab
    if not template and gemma:
        template = GEMMA_CHAT_TEMPLATE  # Gemma files often carry none
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids: dict[str, int | list[int]] = {"eos_token_id": int(eos_id)}
    if gemma:
        # A Gemma turn ends with <end_of_turn>, as its generation_config says.
        ids["eos_token_id"] = [int(eos_id), vocab["<end_of_turn>"]]
    if bos_id is not None:
        ids["bos_token_id"] = int(bos_id)
    return ids


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a normal token into two
    tokens, ordered by the merged token's score (higher first), then by its pieces' ids
    (as transformers' SentencePiece extractor orders them)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, index in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[index], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _arch(metadata: dict[str, Any]) -> str:
    return str(meta_value(metadata, "general.architecture", "llama"))
