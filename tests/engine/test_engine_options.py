"""SamplingParams and EngineConfig refuse bad values with the field and value named."""

from __future__ import annotations

import pytest

from batchd.engine.config import EngineConfig
from batchd.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": 0}, "SamplingParams.max_tokens must be an int >= 1, got 0"),
        ({"temperature": -0.5}, "SamplingParams.temperature must be a number >= 0, got -0.5"),
        ({"top_p": 0.0}, "SamplingParams.top_p must be a number in (0, 1], got 0.0"),
        ({"top_k": -1}, "SamplingParams.top_k must be an int >= 0 (0: off), got -1"),
        ({"min_p": 1.5}, "SamplingParams.min_p must be a number in [0, 1], got 1.5"),
        ({"repetition_penalty": 0}, "SamplingParams.repetition_penalty must be a number > 0"),
        ({"logprobs": 21}, "SamplingParams.logprobs must be an int in 0..20, got 21"),
        ({"stop": ("",)}, "SamplingParams.stop must be a tuple of non-empty strings"),
        ({"stop": "end"}, "SamplingParams.stop must be a tuple of non-empty strings, got 'end'"),
        ({"stop_token_ids": (1.5,)}, "SamplingParams.stop_token_ids must be a tuple of token"),
        ({"seed": "7"}, "SamplingParams.seed must be an int or None, got '7'"),
        ({"temperature": float("nan")}, "SamplingParams.temperature must be a number >= 0"),
    ],
)
def test_sampling_params_name_the_bad_field(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_sampling_params_defaults_and_normalisation() -> None:
    params = SamplingParams(stop=["###"], stop_token_ids=[2, 3])  # type: ignore[arg-type]
    assert (params.stop, params.stop_token_ids) == (("###",), (2, 3))
    assert params.greedy and not SamplingParams(temperature=0.7).greedy
    assert hash(params) == hash(SamplingParams(stop=("###",), stop_token_ids=(2, 3)))
    assert SamplingParams().max_tokens == 16


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": 0}, "EngineConfig.max_num_seqs must be >= 1, got 0"),
        (
            {"max_num_seqs": 64, "max_num_batched_tokens": 32},
            "EngineConfig.max_num_batched_tokens must be >= max_num_seqs (64)",
        ),
        ({"block_size": 0}, "EngineConfig.block_size must be >= 1, got 0"),
        ({"num_kv_blocks": 0}, "EngineConfig.num_kv_blocks must be None or >= 1, got 0"),
        ({"kv_memory_fraction": 1.5}, "EngineConfig.kv_memory_fraction must be in (0, 1], got 1.5"),
        ({"kv_tokens_per_seq": 0}, "EngineConfig.kv_tokens_per_seq must be >= 1, got 0"),
        ({"aging_rate": -1.0}, "EngineConfig.aging_rate must be >= 0, got -1.0"),
        ({"max_model_len": 0}, "EngineConfig.max_model_len must be None or >= 1, got 0"),
        ({"dtype": "int8"}, "EngineConfig.dtype must be one of ('float32', 'float16', 'bfloat16')"),
    ],
)
def test_engine_config_names_the_bad_field(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig(**options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_engine_config_is_keyword_only_with_documented_defaults() -> None:
    config = EngineConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (32, 512, 16)
    assert config.enable_chunked_prefill and config.enable_prefix_caching
    assert config.aging_rate == 0.1 and config.num_kv_blocks is None
    assert (config.kv_tokens_per_seq, config.kv_memory_fraction) == (1024, 0.5)
    with pytest.raises(TypeError):
        EngineConfig(32)  # type: ignore[call-arg]
