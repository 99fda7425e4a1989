"""The README's Python examples run as written and print what the README says they print.

A code block preceded by ``<!-- test: NAME -->`` runs here, with the check of the same
name: the producer examples against a private redis-server and a real ``batchd serve``
subprocess on the tiny random-weight model (gibberish text, so the checks are on shape:
printed once, complete, non-empty), the engine example in a folder where the command its
comment names has made the model. The only change made to an example is the Redis URL,
pointed at the private server. The docs pages' marked blocks run with the same checks
(tests/docs/test_docs_examples.py); every check here has its example in one or the other.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from batchd.daemon.cli import main
from batchd.producers.client import Client
from batchd.producers.schema import FinishReason, JobState
from support.daemon_harness import ROOT
from support.tiny_daemon import tiny_daemon

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_URL = "redis://127.0.0.1:6379/0"
MARKED_BLOCK = re.compile(r"^<!-- test: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)


def marked_examples() -> dict[str, str]:
    """NAME -> code of every marked Python block, in README order."""
    found = MARKED_BLOCK.findall(README.read_text())
    names = [name for name, _ in found]
    assert len(set(names)) == len(names), f"a test name is used twice: {names}"
    return dict(found)


def docs_example_names() -> set[str]:
    """NAME of every marked Python block of the docs pages."""
    pages = DOCS.rglob("*.md")
    return {name for page in pages for name, _ in MARKED_BLOCK.findall(page.read_text())}


@dataclass(frozen=True)
class Served:
    """The private Redis and the daemon serving it."""

    url: str
    redis: redis.Redis


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Served]:
    """One redis-server and one ``batchd serve`` (tiny model) for every example here."""
    with tiny_daemon(tmp_path_factory.mktemp("readme"), tiny_model) as url:
        connection = redis.Redis.from_url(url)
        yield Served(url, connection)
        connection.close()


def job_ids(connection: redis.Redis) -> set[str]:
    """Ids of the jobs Redis holds (their status hashes)."""
    keys = (key.decode() for key in connection.scan_iter("batchd:job:*"))
    return {key.split(":")[2] for key in keys if key.count(":") == 2}


def run_example(code: str, namespace: dict[str, Any]) -> str:
    """Run a README block in ``namespace``; what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    return out.getvalue()


def with_private_redis(code: str, served: Served) -> str:
    assert README_URL in code, "the example no longer names the README's Redis URL"
    return code.replace(README_URL, served.url)


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 lacks."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# -- the checks, one per marked block ------------------------------------------------------


def check_streaming(code: str, served: Served, namespace: dict[str, Any]) -> str:
    """A streaming example prints each of its jobs' text once, as a line of its own."""
    before = job_ids(served.redis)
    printed = run_example(with_private_redis(code, served), namespace)
    (job_id,) = job_ids(served.redis) - before
    with Client(served.url) as client:
        result = client.result(job_id, timeout=30)
    assert result.text, "the tiny model gave no text: the example would print an empty line"
    assert printed == result.text + "\n"
    return job_id


def check_client(code: str, served: Served, tmp: Path) -> None:
    namespace: dict[str, Any] = {}
    job_id = check_streaming(code, served, namespace)
    client, job = namespace["client"], namespace["job"]
    assert job.id == job_id and namespace["result"].text
    assert client.status(job.id).state is JobState.finished  # as its comment says
    assert client.cancel(job.id) is False  # "it had already ended"
    client.close()


def check_async_client(code: str, served: Served, tmp: Path) -> None:
    check_streaming(code, served, {})


def check_quickstart_client(code: str, served: Served, tmp: Path) -> None:
    """The README's service quickstart (tests/test_quickstart.py runs it on SmolLM2)."""
    check_streaming(code, served, {})


def check_n(code: str, served: Served, tmp: Path) -> None:
    with Client(served.url) as client:
        namespace: dict[str, Any] = {"client": client}  # the client example's
        assert run_example(code, namespace) == ""
    choices = namespace["result"].choices
    assert [c.index for c in choices] == [0, 1, 2, 3]  # "four samples"
    assert all(c.token_ids and c.finish_reason for c in choices)


def check_prompt_logprobs(code: str, served: Served, tmp: Path) -> None:
    with Client(served.url) as client:
        namespace: dict[str, Any] = {"client": client}
        assert run_example(code, namespace) == ""
    pairs = namespace["result"].prompt_logprobs
    assert len(pairs) > 1 and pairs[0][1] is None  # the first token has none
    assert all(isinstance(logprob, float) and logprob <= 0 for _, logprob in pairs[1:])


def check_engine(code: str, served: Served, tmp: Path) -> None:
    """Made as its comment says, the model loads; each request's lines end with a finish."""
    with working_directory(tmp):
        assert main(["make-model", "models/tiny"]) == 0
        printed = run_example(code, {})
    lines: dict[str, list[str]] = {"r1": [], "r2": []}
    for line in printed.splitlines():
        request, _, rest = line.partition(" ")
        if request in lines:
            lines[request].append(rest.rsplit(" ", 1)[-1])
    for request, finishes in lines.items():
        assert finishes and finishes[-1] != "None", (request, printed)
        assert set(finishes[:-1]) <= {"None"}, (request, printed)
        assert len(finishes) <= (32 if request == "r1" else 16)


CHECKS: dict[str, Callable[[str, Served, Path], None]] = {
    "client": check_client,
    "async-client": check_async_client,
    "quickstart-client": check_quickstart_client,
    "n": check_n,
    "prompt-logprobs": check_prompt_logprobs,
    "engine": check_engine,
}


def test_every_marked_example_has_its_check() -> None:
    readme = set(marked_examples())
    assert readme <= set(CHECKS), readme - set(CHECKS)
    # A check whose example left the README runs on the docs page the example moved to.
    unused = set(CHECKS) - readme - docs_example_names()
    assert not unused, f"checks with no example in the README or the docs: {unused}"


@pytest.mark.parametrize("name", list(marked_examples()))
def test_readme_example(name: str, served: Served, tmp_path: Path) -> None:
    CHECKS[name](marked_examples()[name], served, tmp_path)


def test_the_final_event_repeats_the_text(served: Served) -> None:
    """Why the streaming examples skip the final event: it carries the whole text again."""
    with Client(served.url) as client:
        events = list(client.submit(prompt="Once upon a time", max_tokens=8).stream(timeout=30))
    assert events[-1].final and events[-1].finish_reason in (FinishReason.stop, FinishReason.length)
    assert events[-1].text == "".join(e.text for e in events[:-1])
