"""The documentation's examples run as written: its marked Python blocks, and the shell
producer docs/examples/produce.sh.

A Python block preceded by ``<!-- test: NAME -->`` runs with the README's check of that
name (tests/test_readme_examples.py: one private redis-server and a real ``batchd
serve`` on the tiny model for all of them), or with a check below for the examples the
README does not have. The only changes made to an example are the addresses (Redis URL,
gateway URL) and, for the OpenAI examples, the model's name (the tiny model's).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import test_readme_examples as readme
import uvicorn

from batchd.producers.bulk_worker import bulk_worker
from batchd.producers.client import Client
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from support.asgi import serve_in_thread
from support.daemon_harness import ROOT
from support.redis_server import free_port

DOCS = ROOT / "docs"
Served = readme.Served
run_example = readme.run_example
# The README examples' fixture: one private redis-server and one tiny daemon per module.
served = readme.served
MARKED_BLOCK = re.compile(r"^<!-- test: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)
GATEWAY_URL = "http://127.0.0.1:8000/v1"
API_KEY = "sk-mine"


def marked_examples() -> list[tuple[str, str, str]]:
    """(page, NAME, code) of every marked Python block of the docs, in page order."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for name, code in MARKED_BLOCK.findall(page.read_text()):
            found.append((str(page.relative_to(DOCS)), name, code))
    return found


@contextlib.contextmanager
def gateway(redis_url: str, files_dir: Path | None = None) -> Iterator[str]:
    """``batchd gateway --api-key sk-mine`` in uvicorn on a thread (its Batch API files in
    ``files_dir``, when given); yields its /v1 URL."""
    port = free_port()
    options = GatewayOptions(api_keys=[API_KEY])
    if files_dir is not None:
        options = GatewayOptions(api_keys=[API_KEY], files_dir=files_dir)
    app = create_app(redis_url, options)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    with serve_in_thread(config) as url:
        yield f"{url}/v1"


def check_openai(code: str, served: Served, tmp: Path) -> None:
    """The OpenAI SDK example prints the reply's text, through a real gateway."""
    assert GATEWAY_URL in code and 'model="smollm2"' in code
    with gateway(served.url) as url:
        models = openai.OpenAI(base_url=url, api_key=API_KEY).models.list()
        model = models.data[0].id
        printed = run_example(
            code.replace(GATEWAY_URL, url).replace('model="smollm2"', f"model={model!r}"), {}
        )
    assert printed.strip(), "the example printed no reply"


def check_openai_batch(code: str, served: Served, tmp: Path) -> None:
    """The Batch API example uploads the file the page's ``printf`` line writes and starts
    a batch, which a bulk worker on the gateway's files folder then completes."""
    page = (DOCS / "gateway.md").read_text()
    (make_file,) = re.findall(r"^printf .*> requests\.jsonl$", page, re.M)
    assert GATEWAY_URL in code and '"model": "smollm2"' in make_file
    files = tmp / "files"
    with gateway(served.url, files) as url:
        model = openai.OpenAI(base_url=url, api_key=API_KEY).models.list().data[0].id
        made = subprocess.run(["bash", "-c", make_file], cwd=tmp, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        requests = tmp / "requests.jsonl"
        requests.write_text(requests.read_text().replace('"smollm2"', json.dumps(model)))
        with readme.working_directory(tmp):
            printed = run_example(code.replace(GATEWAY_URL, url), {})
        assert printed == "validating\n", printed
        connection = redis.Redis.from_url(served.url)
        try:
            assert bulk_worker(connection, files_dir=files, burst=True, fork=False)
        finally:
            connection.close()
        client = openai.OpenAI(base_url=url, api_key=API_KEY)
        (batch,) = client.batches.list().data
        assert batch.status == "completed" and batch.output_file_id, batch
        output = client.files.content(batch.output_file_id).text.splitlines()
    (line,) = [json.loads(text) for text in output]
    assert line["custom_id"] == "r1"
    assert line["response"]["body"]["choices"][0]["message"]["content"], line


CHECKS: dict[str, Callable[[str, Served, Path], None]] = {
    **readme.CHECKS,
    "openai": check_openai,
    "openai-batch": check_openai_batch,
}


def test_every_marked_example_has_its_check() -> None:
    names = {name for _, name, _ in marked_examples()}
    assert names <= set(CHECKS), names - set(CHECKS)
    assert {"client", "async-client", "openai", "engine"} <= names


@pytest.mark.parametrize(
    ("page", "name", "code"), marked_examples(), ids=[f"{p}:{n}" for p, n, _ in marked_examples()]
)
def test_docs_example(page: str, name: str, code: str, served: Served, tmp_path: Path) -> None:
    CHECKS[name](code, served, tmp_path)


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed (config/bootstrap.sh)")
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_the_shell_producer_prints_the_answer(served: Served) -> None:
    """produce.sh submits through the raw protocol and prints the job's text, once."""
    done = subprocess.run(
        ["bash", str(DOCS / "examples" / "produce.sh"), "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "BATCHD_REDIS_URL": served.url},
    )
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"^job (\S+)$", done.stderr, re.M)
    assert job_id, done.stderr
    with Client(served.url) as client:
        result = client.result(job_id.group(1), timeout=30)
    assert result.text and done.stdout == result.text + "\n"
    assert f"finish_reason: {result.finish_reason.value}" in done.stderr


def test_the_shell_producer_refuses_an_id_twice(served: Served, tmp_path: Path) -> None:
    """The submit script creates nothing for an id that exists (run here by redis-py)."""
    script = re.search(r"submit='(.*?)'\n", (DOCS / "examples" / "produce.sh").read_text(), re.S)
    assert script
    keys = ["batchd:job:docs-dup", "batchd:queue:docs-dup"]
    args: list[Any] = ["docs-dup", "1", '{"id": "docs-dup", "prompt": "x"}']
    assert served.redis.eval(script.group(1), 2, *keys, *args) == 1
    assert served.redis.eval(script.group(1), 2, *keys, *args) == 0
    assert served.redis.xlen(keys[1]) == 1
