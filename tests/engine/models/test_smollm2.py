"""SmolLM2-135M-Instruct through the GGUF import: a broken conversion cannot pass.

A wrong rope layout, tokenizer or dequantization still produces fluent-looking
tokens on random prompts; it does not answer questions. So the converted model
must answer a few factual questions correctly (greedy, through batchd's own
engine, several at once), and the tokenizer must round-trip what users type.
"""

from __future__ import annotations

import json
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.models.loader import LoadedModel, load

# (question, a word the answer must contain): answered correctly by the real model.
QUESTIONS = [
    ("What is the capital of France? Answer in one sentence.", "Paris"),
    ("What is 2+2?", "4"),
    ("What color is the sky on a clear day? Answer in one word.", "blue"),
    ("What is the largest ocean on Earth?", "Pacific"),
]


@pytest.fixture(scope="module")
def smollm2(smollm2_model: Path) -> LoadedModel:
    return load(smollm2_model)


def answers(loaded: LoadedModel, questions: list[str], *, max_tokens: int = 24) -> list[str]:
    """Greedy answers from batchd's engine, all questions in one batch."""
    eng = LLMEngine(loaded, EngineConfig(max_num_seqs=8, num_kv_blocks=128))
    texts = {f"q{i}": "" for i in range(len(questions))}
    for i, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        eng.add_request(f"q{i}", messages=messages, params=SamplingParams(max_tokens=max_tokens))
    while eng.has_unfinished():
        for out in eng.step():
            texts[out.request_id] += out.text
    return [texts[f"q{i}"] for i in range(len(questions))]


def test_conversion_writes_an_mlx_lm_llama(smollm2_model: Path) -> None:
    config = json.loads((smollm2_model / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True  # GGUF's q/k are permuted for this rope
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert "quantization" not in config  # dequantized to float32 for the CPU
    tokenizer_config = json.loads((smollm2_model / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_answers_factual_questions(smollm2: LoadedModel) -> None:
    got = answers(smollm2, [q for q, _ in QUESTIONS])
    for (question, word), answer in zip(QUESTIONS, got, strict=True):
        assert word.lower() in answer.lower(), f"{question!r} -> {answer!r}"
    assert got[0].strip() == "The capital of France is Paris."


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld, ñandú",
        "日本語のテキスト",
        "emoji 😀👍🏽 and a family 👨‍👩‍👧",
        "<|im_start|>user\nHi 12345<|im_end|>\n",
        "  leading spaces\ttabs\nand\r\nnewlines  ",
    ],
)
def test_tokenizer_round_trip(smollm2: LoadedModel, text: str) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>assistant<|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[-1] == tok.eos_token_id == 2
    assert 2 in tok.eos_token_ids


@pytest.mark.slow
def test_kept_quantized_weights_answer_too(tmp_path: Path) -> None:
    """The --keep-quantized path: MLX affine triples (Q4_1 layers, Q8_0 embedding) as is."""
    from batchd.engine.models.gguf_convert import convert_gguf
    from batchd.engine.models.registry import packaged_gguf

    path = convert_gguf(packaged_gguf("smollm2"), tmp_path / "q", keep_quantized=True)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert config["quantization"]["model.layers.0.self_attn.q_proj"]["bits"] == 4
    got = answers(load(path), [q for q, _ in QUESTIONS[:2]], max_tokens=12)
    assert "Paris" in got[0] and "4" in got[1], got
