"""``batchd submit | stream | status | cancel`` against a real redis-server."""

from __future__ import annotations

import json

import pytest

from batchd.daemon.cli import main
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
