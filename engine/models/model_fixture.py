"""Random-weight model directories that load like downloaded ones.

Tests, the demo and the benchmark need models, and nothing can be
downloaded. A fixture model is an ordinary mlx-lm model directory
(config.json, safetensors weights, a byte-level BPE tokenizer trained here
with ``tokenizers``), so every code path that loads a real checkpoint is
exercised. Weights come from a seeded NumPy generator: the same seed gives
byte-identical files on every machine.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import numpy as np

from batchd.engine.models.presets import FIXTURE_PRESETS as PRESETS

ARCHES = ("llama", "qwen3")
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<s>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Logit spread matters for tests: with a tiny init the logits are nearly flat
# and float rounding decides greedy ties. An output head scaled to give logits
# of standard deviation ~4 makes near-ties rare, as in trained models.
_HEAD_LOGIT_STD = 4.0
_WEIGHT_STD = 0.15


@dataclass(frozen=True)
class FixtureSpec:
    """What make_model builds: preset shape, architecture, seed, quantization."""

    preset: str = "tiny"
    arch: str = "llama"
    seed: int = 0
    quantize_bits: int | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} unknown; choose from {sorted(PRESETS)}")
        if self.arch not in ARCHES:
            raise ValueError(f"arch {self.arch!r} unknown; choose from {list(ARCHES)}")
        if self.quantize_bits not in (None, 2, 3, 4, 6, 8):
            raise ValueError(f"quantize_bits {self.quantize_bits!r} must be one of 2,3,4,6,8")


def model_config(spec: FixtureSpec, tokenizer_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json of a fixture model, in Hugging Face / mlx-lm form."""
    shape = dict(PRESETS[spec.preset])
    heads = shape["num_attention_heads"]
    config: dict[str, Any] = {
        "model_type": spec.arch,
        "architectures": ["LlamaForCausalLM" if spec.arch == "llama" else "Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-5 if spec.arch == "llama" else 1e-6,
        "rope_theta": shape.pop("rope_theta", 10000.0),
        "tie_word_embeddings": spec.arch == "qwen3",
        "head_dim": shape["hidden_size"] // heads,
        "bos_token_id": tokenizer_ids[BOS],
        "eos_token_id": tokenizer_ids[EOS],
        **shape,
    }
    if spec.arch == "llama":
        config.setdefault("rope_scaling", None)
        config["attention_bias"] = False
        config["mlp_bias"] = False
    else:
        config.pop("rope_scaling", None)
    return config


def _corpus(seed: int, words: int) -> list[str]:
    """Deterministic pseudo-English lines: enough distinct substrings for BPE merges."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "qu",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "br",
        "ch",
        "cl",
        "dr",
        "fl",
        "gr",
        "pl",
        "pr",
        "sh",
        "st",
        "th",
        "tr",
        "wh",
    ]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "io", "ou", "oo"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rk", "ck", "x"]
    lexicon = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(20000)
    ]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines: list[str] = []
    line: list[str] = []
    for word in rng.choices(lexicon, weights=weights, k=words):
        line.append(word.capitalize() if not line else word)
        if len(line) >= rng.randint(6, 16):
            lines.append(
                " ".join(line) + rng.choice([".", "!", "?", ",", ";", ":"]) + " 0123456789"
            )
            line = []
    lines.append("Hello, world! héllo wörld ñ 日本語 😀 {}[]()<>#@$%^&*_+=-/\\|~`'\"")
    return lines


def build_tokenizer(vocab_size: int, seed: int, out_dir: Path) -> dict[str, int]:
    """Train a byte-level BPE of exactly ``vocab_size`` ids; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, words=max(50_000, vocab_size * 12)), trainer=trainer)
    learned = tok.get_vocab_size()
    if learned < vocab_size:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - learned)])
    ids: dict[str, int] = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}  # type: ignore[misc]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "</s>",
        "unk_token": None,
        "add_bos_token": True,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS})
    return ids


def random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded weights for every parameter mlx-lm's model class declares."""
    import importlib

    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Shapes only: the values come from NumPy, for cross-platform determinism.
    params: Any = tree_flatten(model.parameters())
    shapes = {name: tuple(p.shape) for name, p in params}
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    weights: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith("embed_tokens.weight") and config["tie_word_embeddings"]:
            weights[name] = rng.normal(0, _HEAD_LOGIT_STD / hidden**0.5, shape).astype(np.float32)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = rng.normal(0, 1.0, shape).astype(np.float32)
        elif name.startswith("lm_head"):
            weights[name] = rng.normal(0, _HEAD_LOGIT_STD / hidden**0.5, shape).astype(np.float32)
        else:
            weights[name] = rng.normal(0, _WEIGHT_STD, shape).astype(np.float32)
    return weights


def make_model(out_dir: str | Path, spec: FixtureSpec | None = None) -> Path:
    """Write a fixture model directory; returns its path. Overwrites files it owns."""
    import mlx.core as mx

    spec = spec or FixtureSpec()
    out = Path(out_dir)
    if spec.quantize_bits is not None:
        return _make_quantized(out, spec)
    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(PRESETS[spec.preset]["vocab_size"], spec.seed, out)
    config = model_config(spec, ids)
    dtype = getattr(mx, config["torch_dtype"])
    arrays = {k: mx.array(v).astype(dtype) for k, v in random_weights(config, spec.seed).items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]}
    )
    return out


def _make_quantized(out: Path, spec: FixtureSpec) -> Path:
    from mlx_lm.convert import convert

    full = FixtureSpec(preset=spec.preset, arch=spec.arch, seed=spec.seed)
    with tempfile.TemporaryDirectory(prefix="batchd-fixture-") as tmp:
        make_model(Path(tmp) / "full", full)
        if out.exists():
            shutil.rmtree(out)
        convert(str(Path(tmp) / "full"), str(out), quantize=True, q_bits=spec.quantize_bits)
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
