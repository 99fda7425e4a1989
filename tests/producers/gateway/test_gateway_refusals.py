"""The real daemon's refusals of a request's own content are 400s naming the parameter,
never 500s (security finding 6), and a grammar's end holds through the daemon whatever
ignore_eos says (finding 8): the tiny model on a real daemon behind the gateway.

Before the fix an out-of-vocabulary prompt token id or logit_bias key answered 500
(which the OpenAI SDK retries), and ``[0-9]{1,3}`` with ignore_eos gave
``23<|im_end|>``.
"""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from batchd.producers.client import Client

MODEL = "tiny"
OUT_OF_VOCAB = 2**31 - 1  # a valid token id for the protocol, beyond any vocabulary


def test_out_of_vocabulary_prompt_ids_are_a_400_on_prompt(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=MODEL, prompt=[5, 6, OUT_OF_VOCAB], max_tokens=2)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "prompt", error
    assert error["code"] == "invalid_value" and str(OUT_OF_VOCAB) in error["message"]


def test_out_of_vocabulary_logit_bias_is_a_400_on_logit_bias(oai: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, logit_bias={str(OUT_OF_VOCAB): 5}
        )
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "logit_bias", error


def test_models_show_no_local_path(oai: openai.OpenAI, daemon: Any) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]  # the daemon serves /tmp/.../tiny
    assert oai.models.retrieve(MODEL).id == MODEL


def test_a_grammars_end_holds_with_ignore_eos(gateway: Any) -> None:
    client = Client(gateway.redis_url)
    pattern = "[0-9]{1,3}"
    handles = [
        client.submit(
            prompt_token_ids=[5, 6, 7, 10 + seed],
            max_tokens=12,
            temperature=1.5,
            seed=seed,
            ignore_eos=True,
            response_format={"type": "regex", "regex": pattern},
        )
        for seed in range(24)
    ]
    for handle in handles:
        result = handle.result(timeout=60)
        assert re.fullmatch(pattern, result.text), (handle.id, result.text)
        assert result.finish_reason.value == "stop"
