"""Adapters through the daemon and the gateway: ``batchd serve --adapter`` on the tiny
model, jobs naming an adapter (and one it does not serve), and the gateway's model
``tiny:alpha`` listed by /v1/models and served with the adapter."""

from __future__ import annotations

import os
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import openai
import orjson
import pytest

from batchd.config.sections import GatewaySettings
from batchd.daemon.cli import build_parser, settings_from_args
from batchd.daemon.commands.serve import apply_args
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.adapters.adapter_fixture import make_adapter
from batchd.engine.models.loader import load
from batchd.producers.client import Client
from batchd.producers.errors import JobFailed
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.batch_lines import BatchLines, ServedModels
from batchd.producers.gateway.fleet import names, split_adapter
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.server import uvicorn_config
from batchd.producers.schema import DaemonHeartbeat
from support.asgi import serve_in_thread
from support.daemon_harness import DaemonProcess, daemon_config, wait_heartbeat
from support.redis_server import RedisServer, free_port

PROMPT = [17, 250, 3, 999, 42, 42, 7, 610, 12, 88]
API_KEY = "sk-test-lora"


def _engine_tokens(model: Path, adapter: Path) -> dict[str | None, list[int]]:
    """The in-process engine's greedy tokens for PROMPT, base and with the adapter."""
    eng = LLMEngine(load(model), EngineConfig(adapters={"alpha": str(adapter)}))
    out: dict[str | None, list[int]] = {}
    for name in (None, "alpha"):
        params = SamplingParams(max_tokens=8)
        eng.add_request(str(name), prompt_token_ids=PROMPT, params=params, adapter=name)
        out[name] = []
        while eng.has_unfinished():
            out[name] += [o.token_id for o in eng.step()]
    return out


def test_jobs_and_gateway_models_name_adapters(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    alpha = make_adapter(tmp_path / "alpha", load(tiny_model).model, seed=1)
    expected = _engine_tokens(tiny_model, alpha)
    assert expected["alpha"] != expected[None]
    daemon = DaemonProcess(
        daemon_config(tmp_path, redis_server.url),
        model=tiny_model,
        log_path=tmp_path / "d.log",
        extra_args=["--adapter", f"alpha={alpha}"],
    ).wait_serving()
    try:
        wait_heartbeat(redis_server.url)
        with Client(redis_server.url) as client:
            jobs = {
                name: client.submit(prompt_token_ids=PROMPT, max_tokens=8, adapter=name)
                for name in (None, "alpha")
            }
            unknown = client.submit(prompt_token_ids=PROMPT, max_tokens=8, adapter="gamma")
            results = {name: job.result(timeout=120) for name, job in jobs.items()}
            with pytest.raises(JobFailed, match=r"adapter 'gamma' is not served \(served: alpha"):
                unknown.result(timeout=120)
            assert {n: r.token_ids for n, r in results.items()} == expected
            # The daemon goes on serving after the refused job.
            again = client.submit(prompt_token_ids=PROMPT, max_tokens=8, adapter="alpha")
            assert again.result(timeout=120).token_ids == expected["alpha"]
        options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path / "files")
        settings = GatewaySettings(host="127.0.0.1", port=free_port())
        app = create_app(redis_server.url, options)
        with serve_in_thread(uvicorn_config(app, settings, log_level="warning")) as url:
            api = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            assert {m.id for m in api.models.list()} == {"tiny", "tiny:alpha"}
            answer = api.completions.create(
                model="tiny:alpha", prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert answer.model == "tiny:alpha"
            assert answer.choices[0].text == results["alpha"].text
            base = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert base.choices[0].text == results[None].text != results["alpha"].text
    finally:
        daemon.kill()


def _beat(model: str, adapters: list[str]) -> DaemonHeartbeat:
    return DaemonHeartbeat(
        consumer="c",
        model=model,
        queues=["default"],
        instance="h:1:t",
        pid=1,
        host="h",
        started_at=0.0,
        at=0.0,
        adapters=adapters,
    )


def test_gateway_names_of_adapters_and_batch_lines_carry_them() -> None:
    served = names([_beat("/srv/models/tiny", ["alpha"]), _beat("org/x:y", [])])
    assert served["tiny:alpha"] == served["/srv/models/tiny:alpha"] == "tiny:alpha"
    assert split_adapter("tiny:alpha", served) == ("tiny", "alpha")
    assert split_adapter("tiny", served) == ("tiny", None)
    assert split_adapter("org/x:y", served) == ("org/x:y", None)  # a model's own ':'
    assert "tiny:beta" not in served
    lines = BatchLines(
        endpoint="/v1/completions",
        secret="s",
        key_id="k",
        models=ServedModels(lambda: served),
        limits=None,
    )
    for model, adapter in (("tiny:alpha", "alpha"), ("tiny", None)):
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        raw = orjson.dumps(
            {"custom_id": model, "method": "POST", "url": "/v1/completions", "body": body}
        )
        job, echo = lines.job(1 if adapter else 2, raw)
        assert (job.adapter, echo["model"]) == (adapter, model)


def test_adapters_from_the_environment_and_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("BATCHD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHD_ENGINE__ADAPTERS", '{"a": "/srv/a", "b": "/srv/b"}')
    args = build_parser().parse_args(
        ["serve", "--preset", "tiny", "--adapter", "b=/opt/b", "--adapter", "c=/opt/c"]
    )
    settings = apply_args(settings_from_args(args), args)
    assert settings.engine.adapters == {"a": "/srv/a", "b": "/opt/b", "c": "/opt/c"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--adapter", "no-path"])
    monkeypatch.setenv("BATCHD_ENGINE__ADAPTERS", '{"a:b": "/srv/a"}')
    with pytest.raises(ValueError, match="EngineConfig.adapters must be a mapping of names"):
        settings_from_args(build_parser().parse_args(["serve"]))
