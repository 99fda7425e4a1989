"""``batchd submit | stream | status | cancel`` against a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchd.daemon.cli import main
from batchd.producers.keys import JOB_FIELD, Keys
from support.redis_server import RedisServer
from support.text_daemon import expected_text, text_daemon


def run(
    capsys: pytest.CaptureFixture[str], server: RedisServer, *argv: str
) -> tuple[int, str, str]:
    code = main(["--redis-url", server.url, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_prints_id_then_status_and_cancel(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, redis_server, "submit", "hello", "--max-tokens", "4", "--id", "c1")
    assert (code, out) == (0, "c1\n")
    code, out, _ = run(capsys, redis_server, "status", "c1", "--json")
    status = json.loads(out)
    assert (code, status["id"], status["state"], status["queue"]) == (0, "c1", "queued", "default")
    code, out, _ = run(capsys, redis_server, "cancel", "c1")
    assert (code, out) == (0, "cancel requested for c1\n")
    code, out, _ = run(capsys, redis_server, "status", "c1")
    assert "cancel_requested: True" in out.splitlines()


def test_submit_wait_and_stream(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with text_daemon(redis_server.url, token_delay_s=0.002):
        code, out, _ = run(capsys, redis_server, "submit", "abc", "--max-tokens", "7", "--wait")
        assert (code, out) == (0, expected_text("abc", 7) + "\n")
        code, out, _ = run(
            capsys, redis_server, "submit", "xy", "--max-tokens", "5", "--stream", "--id", "s1"
        )
        assert (code, out) == (0, expected_text("xy", 5) + "\n")
        code, out, _ = run(capsys, redis_server, "submit", "q", "--max-tokens", "2", "--json")
        assert code == 0 and json.loads(out)["queue"] == "default"
        code, out, _ = run(
            capsys, redis_server, "submit", "j", "--max-tokens", "3", "--wait", "--json"
        )
        result = json.loads(out)
        assert (result["text"], result["finish_reason"]) == ("jjj", "length")
    code, out, _ = run(capsys, redis_server, "stream", "s1", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [e["seq"] for e in lines] == [0, 1, 2, 3, 4, 5]
    assert lines[-1]["finish_reason"] == "length"
    code, out, _ = run(capsys, redis_server, "cancel", "s1")
    assert (code, out) == (0, "s1 already ended (finished)\n")


def test_errors_have_messages_and_exit_codes(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, redis_server, "submit", "x", "--temperature", "-1")
    assert code == 2 and "invalid request: temperature:" in err
    code, _, err = run(capsys, redis_server, "submit", "x", "--max-tokens", "999999")
    assert code == 2 and "exceeds the cap" in err
    for command in ("status", "stream", "cancel"):
        code, _, err = run(capsys, redis_server, command, "ghost")
        assert code == 1 and "job ghost not found" in err
    code, _, err = run(capsys, redis_server, "submit", "x", "--wait", "--timeout", "0.2")
    assert code == 4 and "did not finish within 0.2s" in err
    with text_daemon(redis_server.url):
        code, out, err = run(capsys, redis_server, "submit", "!fail", "--stream")
    assert code == 1 and out == "!\n" and "ended with error: fake failure" in err
    redis_server.kill()
    code, _, err = run(capsys, redis_server, "status", "any")
    assert code == 3 and "cannot reach Redis at redis://127.0.0.1" in err


def queued_job(server: RedisServer, job_id: str) -> dict[str, Any]:
    """The job as it travels on the queue stream: what a daemon will read."""
    with server.client() as client:
        entries: Any = client.xrange(Keys().queue("default"))
    jobs = [orjson.loads(fields[JOB_FIELD.encode()]) for _, fields in entries]
    (job,) = [job for job in jobs if job["id"] == job_id]
    return dict(job)


def test_submit_sends_the_prompt_through_the_chat_template(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default the prompt is a user message (the daemon applies the model's template);
    --system adds a system message; --raw sends the text as it is."""
    question = "What is the capital of France?"
    assert run(capsys, redis_server, "submit", question, "--id", "chat")[0] == 0
    job = queued_job(redis_server, "chat")
    assert job["messages"] == [{"role": "user", "content": question}] and "prompt" not in job
    code, _, _ = run(capsys, redis_server, "submit", question, "--system", "Be brief.", "--id", "s")
    assert code == 0
    assert queued_job(redis_server, "s")["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": question},
    ]
    assert run(capsys, redis_server, "submit", question, "--raw", "--id", "raw")[0] == 0
    job = queued_job(redis_server, "raw")
    assert job["prompt"] == question and "messages" not in job
    code, _, err = run(capsys, redis_server, "submit", "x", "--raw", "--system", "S")
    assert code == 2 and "invalid request: system: --system needs the chat template" in err


def test_submit_sampling_options_reach_the_job(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = tmp_path / "answer.schema.json"
    schema.write_text('{"type": "object", "properties": {"city": {"type": "string"}}}')
    argv = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]
    argv += ["--stop", "\n\n", "--stop", "END", "--min-tokens", "2", "--json-schema", str(schema)]
    code, out, _ = run(capsys, redis_server, "submit", "Where?", "--id", "opts", *argv)
    assert (code, out) == (0, "opts\n")
    job = queued_job(redis_server, "opts")
    assert (job["temperature"], job["top_p"], job["top_k"], job["seed"]) == (0.7, 0.9, 40, 7)
    assert (job["stop"], job["min_tokens"]) == (["\n\n", "END"], 2)
    assert job["response_format"]["json_schema"]["properties"] == {"city": {"type": "string"}}
    code, _, err = run(capsys, redis_server, "submit", "x", "--top-k", "-1")
    assert code == 2 and "invalid request: top_k:" in err
    code, _, err = run(capsys, redis_server, "submit", "x", "--stop", "")
    assert code == 2 and "stop strings must not be empty" in err
