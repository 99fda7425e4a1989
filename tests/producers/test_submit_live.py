"""``batchd submit`` through a real daemon on the tiny model (which has a chat template).

What the command line sends must be what the daemon generates from: the chat template by
default, a system message with --system, the bare text with --raw, and the sampling
options; each CLI answer is checked against the same request made with the client. The
daemon is started with ``--preset DIR`` beside ``--model DIR``: both spellings of one
option, resolved by the one model registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchd.daemon.cli import main
from batchd.engine.models.registry import packaged_gguf
from batchd.producers.client import Client
from support.tiny_daemon import tiny_daemon

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("submit-live")
    with tiny_daemon(tmp, tiny_model, serve_args=["--preset", str(tiny_model)]) as redis_url:
        yield redis_url


def cli(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    code = main(["--redis-url", url, "submit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def client_text(url: str, **job: Any) -> str:
    with Client(url) as client:
        return client.submit(**job).result(timeout=30).text


@pytest.mark.parametrize(
    ("flags", "job"),
    [
        ([], {"messages": [{"role": "user", "content": QUESTION}]}),
        (
            ["--system", "Answer in one word."],
            {
                "messages": [
                    {"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": QUESTION},
                ]
            },
        ),
        (["--raw"], {"prompt": QUESTION}),
        (
            ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.8", "--seed", "11"],
            {
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0.9,
                "top_k": 20,
                "top_p": 0.8,
                "seed": 11,
            },
        ),
    ],
    ids=["template", "system", "raw", "sampling"],
)
def test_submit_generates_what_the_same_request_does(
    url: str, capsys: pytest.CaptureFixture[str], flags: list[str], job: dict[str, Any]
) -> None:
    code, out, err = cli(capsys, url, QUESTION, "--max-tokens", "12", "--wait", *flags)
    expected = client_text(url, max_tokens=12, **job)
    assert expected, "the tiny model gave no text: pick another question"
    assert (code, out, err) == (0, expected + "\n", "")
    code, out, _ = cli(capsys, url, QUESTION, "--max-tokens", "12", "--stream", *flags)
    assert (code, out) == (0, expected + "\n")


def test_a_stop_string_ends_the_text_and_no_text_is_said(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopping at the answer's first character leaves no text: the command says so on
    stderr instead of printing an empty line and nothing else."""
    text = client_text(url, prompt=QUESTION, max_tokens=12)
    for mode in ("--wait", "--stream"):
        code, out, err = cli(
            capsys, url, QUESTION, "--raw", "--max-tokens", "12", "--stop", text[0], mode
        )
        assert (code, out) == (0, "\n")
        assert err.startswith("batchd: job ") and "produced no text: it finished (stop)" in err
        assert "--raw skips the chat template" in err
    code, out, err = cli(capsys, url, QUESTION, "--raw", "--max-tokens", "12", "--wait")
    assert (code, out, err) == (0, text + "\n", "")


def test_a_chat_model_answers_the_question(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report this began with: on SmolLM2 the bare question ends at once (its end
    token), so ``--stream`` printed nothing; through the chat template it answers."""
    gguf = str(packaged_gguf("smollm2"))  # converted once into the model cache
    with tiny_daemon(tmp_path, Path(gguf), start_timeout=180) as smollm2:
        code, out, err = cli(capsys, smollm2, QUESTION, "--max-tokens", "24", "--stream")
        assert (code, err) == (0, "") and "Paris" in out, out
        code, out, err = cli(capsys, smollm2, QUESTION, "--max-tokens", "24", "--stream", "--raw")
    assert (code, out) == (0, "\n")
    assert "produced no text: it finished (stop) after 1 token (--raw skips" in err
