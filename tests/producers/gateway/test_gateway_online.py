"""The online endpoints driven by the official openai package (sync and async), against
a real redis-server and a real daemon on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest

from batchd.daemon.cli import main as cli_main
from batchd.producers.client import Client
from batchd.producers.gateway.options import GatewayOptions
from support.daemon_harness import DaemonProcess, daemon_config, wait_until
from support.redis_server import free_port

MODEL = "tiny"
API_KEY = "sk-test-gateway"
HELLO = [{"role": "user", "content": "Hello there"}]


def test_chat_completion_is_the_jobs_text(gateway: Any, oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    client = Client(gateway.redis_url)
    direct = client.submit(messages=HELLO, max_tokens=12, temperature=0.0)
    assert direct.result(timeout=60).text == choice.message.content
    assert client.status(reply.id.removeprefix("chatcmpl-")).state.value == "finished"


def test_text_completion_equals_batchd_submit(
    gateway: Any, oai: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0
    )
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    argv = [
        "--redis-url",
        gateway.redis_url,
        "submit",
        "--raw",
        "Once upon a time",
        "--max-tokens",
        "10",
    ]
    assert cli_main([*argv, "--wait", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["text"] == reply.choices[0].text


def test_chat_stream_chunks_and_usage(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_choices_whole_and_streamed(
    gateway: Any, oai: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    options: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 3}
    whole = oai.chat.completions.create(model=MODEL, messages=HELLO, **options)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **options))
    texts: dict[int, str] = {}
    ends: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert ends == {0: "length", 1: "length", 2: "length"}
    firsts = [next(c for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert all(c.choices[0].delta.role == "assistant" for c in firsts)
    text = oai.completions.create(model=MODEL, prompt="Tell", **options)
    assert len({c.text for c in text.choices}) > 1
    argv = ["--redis-url", gateway.redis_url, "submit", "--raw", "Tell", "--max-tokens", "6"]
    assert (
        cli_main([*argv, "--temperature", "1", "--seed", "9", "-n", "3", "--wait", "--json"]) == 0
    )
    printed = orjson.loads(capsys.readouterr().out)
    assert [c["text"] for c in printed["choices"]] == [c.text for c in text.choices]


def test_prompt_logprobs_as_vllm_shapes_them(
    gateway: Any, oai: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"prompt_logprobs": 0}
    text = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=2, n=2, extra_body=extra
    )
    shaped = [c.model_extra["prompt_logprobs"] for c in text.choices]  # type: ignore[index]
    assert shaped[0] == shaped[1] and shaped[0][0] is None and len(shaped[0]) > 2
    assert all(len(p) == 1 and list(p.values())[0]["logprob"] <= 0 for p in shaped[0][1:])
    argv = [
        "--redis-url",
        gateway.redis_url,
        "submit",
        "--raw",
        "Once upon a time",
        "--max-tokens",
        "2",
    ]
    assert cli_main([*argv, "--prompt-logprobs", "--wait", "--json"]) == 0
    printed = orjson.loads(capsys.readouterr().out)["prompt_logprobs"]
    via_gateway = [(int(token), e["logprob"]) for p in shaped[0][1:] for token, e in p.items()]
    # Same tokens; the values agree to float rounding (the batches around them differ).
    assert [int(t) for t, _ in printed[1:]] == [t for t, _ in via_gateway]
    assert [lp for _, lp in printed[1:]] == pytest.approx([lp for _, lp in via_gateway], abs=1e-4)
    chat = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body=extra)
    assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None
    for refused in ({"prompt_logprobs": 2}, {"prompt_logprobs": 0, "stream": True}):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.completions.create(model=MODEL, prompt="x", extra_body=refused)
        assert caught.value.param == "prompt_logprobs"


def test_async_client_concurrent_streams_and_logprobs(gateway: Any) -> None:
    async def run() -> tuple[list[str], Any]:
        async with openai.AsyncOpenAI(
            base_url=gateway.base_url, api_key=API_KEY, max_retries=0
        ) as client:

            async def one(seed: int) -> str:
                stream = await client.completions.create(
                    model=MODEL,
                    prompt="Tell",
                    max_tokens=6,
                    temperature=0.8,
                    seed=seed,
                    stream=True,
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            texts = await asyncio.gather(*(one(seed) for seed in (1, 2, 1)))
            whole = await client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True
            )
            return list(texts), whole

    texts, whole = asyncio.run(run())
    assert texts[0] == texts[2]  # the same seed, the same text
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 4
    assert all(item.logprob <= 0 for item in logprobs.content)
    assert "".join(i.token for i in logprobs.content) == whole.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"response_format": {"type": "regex", "regex": "a+"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"n": 129}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_unsupported_or_invalid_params_are_400_naming_them(
    oai: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=HELLO, **extra)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_unknown_model_is_404_and_models_lists_the_fleet(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        oai.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert caught.value.code == "model_not_found"
    served = [m.id for m in oai.models.list()]
    assert len(served) == 1 and Path(served[0]).name == MODEL
    assert oai.models.retrieve(MODEL).id == served[0]


def test_auth_and_health(gateway: Any) -> None:
    bad = openai.OpenAI(base_url=gateway.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    health = httpx.get(f"{gateway.url}/health").json()
    assert health == {
        "status": "ok",
        "redis": True,
        "daemons": 1,
        "models": [MODEL],
        "queue": "default",
        "backlog": 0,
        "bulk_workers": 0,
    }
    assert httpx.get(f"{gateway.url}/health/live").json() == {"status": "ok"}


def test_chat_on_a_model_without_a_chat_template_is_a_400(
    gateway: Any, tiny_model: Path, tmp_path: Path, start_gateway: Any
) -> None:
    """The daemon refuses the job ("prompt: cannot tokenize"); the gateway says it is the
    request's messages, and plain completions still work on that model."""
    model = tmp_path / "plain"
    shutil.copytree(tiny_model, model)
    config_path = model / "tokenizer_config.json"
    config = orjson.loads(config_path.read_bytes())
    del config["chat_template"]
    config_path.write_bytes(orjson.dumps(config))
    daemon = DaemonProcess(
        daemon_config(tmp_path, gateway.redis_url),
        model=model,
        log_path=tmp_path / "d.log",
        env={"BATCHD_QUEUES": '["plain"]'},
    ).wait_serving()
    try:
        options = GatewayOptions(queue="plain", files_dir=tmp_path)
        with start_gateway(gateway.redis_url, options) as gw:
            client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
            wait_until(lambda: [m.id for m in client.models.list()] != [], what="heartbeat")
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="plain", messages=HELLO, max_tokens=2)
            assert caught.value.param == "messages" and "chat" in caught.value.message
            text = client.completions.create(model="plain", prompt="x", max_tokens=2)
            assert text.choices[0].finish_reason == "length"
    finally:
        daemon.kill()


def test_batchd_gateway_command(gateway: Any) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "batchd.daemon.cli",
        "--redis-url",
        gateway.redis_url,
        "gateway",
    ]
    env = {**os.environ, "BATCHD_GATEWAY_API_KEYS": "sk-env"}
    proc = subprocess.Popen([*command, "--port", str(port), "--api-key", "sk-flag"], env=env)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{base}/health").json()["daemons"] == 1
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=30, what="batchd gateway")
        for key in ("sk-flag", "sk-env"):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert Path(client.models.list().data[0].id).name == MODEL
    finally:
        proc.terminate()
        assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_json_schema_response_format_holds_the_output_to_the_schema(oai: openai.OpenAI) -> None:
    """The random-weight model writes valid JSON of the schema only because it must."""
    schema = {
        "type": "object",
        "properties": {
            "digit": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["digit", "ok"],
        "additionalProperties": False,
    }
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=64,
        seed=3,
        frequency_penalty=0.5,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}},
    )
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content or ""), schema)


def test_a_chat_without_max_tokens_gets_the_gateways_default(
    redis_url: str, daemon: Any, tmp_path: Path, start_gateway: Any
) -> None:
    options = GatewayOptions(files_dir=tmp_path, default_max_tokens=5)
    with start_gateway(redis_url, options) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
        with_n = client.chat.completions.create(model=MODEL, messages=HELLO, n=2)
    assert reply.usage is not None and reply.usage.completion_tokens <= 5
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert with_n.usage is not None and with_n.usage.completion_tokens <= 10


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_bad_key_is_refused_before_the_body_is_read(gateway: Any, path: str) -> None:
    answer = httpx.post(
        f"{gateway.url}{path}", content=b"not json", headers={"Authorization": "Bearer sk-no"}
    )
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
