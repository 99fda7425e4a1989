"""The README's hand-run quickstarts, tried as a new user would try them.

From the README alone, a reader gets a daemon serving SmolLM2 and a streamed answer
through ``batchd submit``, the Python client and the OpenAI SDK, and a bulk run's results,
each in its quickstart's steps. The fenced blocks marked ``<!-- quickstart: NAME -->``
run here in README order, from a fresh temporary directory, in a shell whose PATH starts
with this virtualenv's ``bin`` (what the README's ``source .venv/bin/activate`` gives).

The only changes are the ones a reader makes for their own machine: a private
redis-server on a free port stands for the reader's Redis, so its URL replaces the
README's ``redis://127.0.0.1:6379/0`` (the ``export BATCHD_REDIS_URL=...`` line) and
the README's ``redis-server`` line is the one step not run; the gateway gets a free port
instead of 8000; and the user's data folder (``XDG_DATA_HOME``: the bulk files folder's
parent) is a fresh one. The model cache is the user's own, so SmolLM2 is converted once,
as the README says. A line ending in ``&`` starts a background process, which the next
steps wait for the way the README says to: the daemon's ``serving queues`` line, the
gateway answering; every other line runs in ``bash`` and must exit 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchd.engine.models.registry import packaged_gguf
from support.daemon_harness import ROOT
from support.redis_server import RedisServer, free_port

README = ROOT / "README.md"
# A marker, then (maybe) other markers of the same block, then the fenced block.
QUICKSTART_BLOCK = re.compile(
    r"^<!-- quickstart: ([\w-]+) -->\n(?:<!--[^\n]*-->\n)*```(sh|python)\n(.*?)^```$",
    re.M | re.S,
)
README_REDIS_URL = "redis://127.0.0.1:6379/0"
README_GATEWAY_PORT = "8000"
QUESTION_ANSWER = "Paris"  # SmolLM2's answer to "What is the capital of France?"
STEP_TIMEOUT = 300  # the first start of SmolLM2 converts it: minutes on a slow machine


def quickstarts() -> dict[str, list[tuple[str, str]]]:
    """NAME -> its blocks (language, code), in README order."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name, language, code in QUICKSTART_BLOCK.findall(README.read_text()):
        found.setdefault(name, []).append((language, code))
    return found


def shell_lines(code: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment lines left out."""
    lines = code.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def without_comment(line: str) -> str:
    """The command a line runs, its trailing ``# ...`` comment cut as bash cuts it: at a
    ``#`` outside quotes that starts a word."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


@dataclass
class Reader:
    """A shell session of the README's reader: one folder, one environment, the
    processes it left running in the background."""

    folder: Path
    env: dict[str, str]
    redis_url: str
    gateway_port: int
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def substitute(self, text: str) -> str:
        """The reader's own Redis and gateway port, in place of the README's."""
        text = text.replace(README_REDIS_URL, self.redis_url)
        url = f"127.0.0.1:{README_GATEWAY_PORT}/"
        text = text.replace(url, f"127.0.0.1:{self.gateway_port}/")
        return text.replace(f"--port {README_GATEWAY_PORT}", f"--port {self.gateway_port}")

    def run_block(self, language: str, code: str) -> list[str]:
        """Run one block; what each of its foreground commands printed."""
        if language == "python":
            return [self.run([sys.executable, "-c", self.substitute(code)], code)]
        printed = []
        for line in shell_lines(code):
            command = without_comment(self.substitute(line))
            if command.startswith("export "):
                (assignment,) = shlex.split(command.removeprefix("export "))
                name, _, value = assignment.partition("=")
                self.env[name] = value
            elif command.startswith("redis-server"):
                continue  # the private redis-server stands for the reader's Redis
            elif command.endswith("&"):
                self.start(command.removesuffix("&").strip())
            else:
                printed.append(self.run(["bash", "-c", command], line))
        return printed

    def run(self, argv: list[str], step: str) -> str:
        done = subprocess.run(
            argv,
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        )
        assert done.returncode == 0, f"{step}\nexit {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout

    def start(self, command: str) -> None:
        """A background process, waited for as the README says."""
        log = self.folder / f"background-{len(self.logs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.folder,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.background.append(proc)
        self.logs.append(log)
        if command.startswith("batchd serve"):
            self.wait(proc, log, lambda: b"serving queues" in log.read_bytes(), "serving queues")
        elif command.startswith("batchd gateway"):
            self.wait(proc, log, self.gateway_answers, "the gateway")

    def gateway_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.gateway_port}/health", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (an unhealthy fleet is a 503)
        except OSError:
            return False

    def wait(
        self, proc: subprocess.Popen[bytes], log: Path, ready: Callable[[], bool], what: str
    ) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT
        while not ready():
            tail = log.read_bytes()[-3000:].decode(errors="replace")
            assert proc.poll() is None, f"{what} exited {proc.returncode}:\n{tail}"
            assert time.monotonic() < deadline, f"{what} not ready:\n{tail}"
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM every background process (the daemon finishes its jobs), newest first."""
        for proc in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.background):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    """A fresh folder and shell, a private Redis, and the README's daemon quickstart run."""
    if importlib.util.find_spec("mlx") is None:
        pytest.skip("the daemon extra is not installed (config/bootstrap.sh installs it)")
    try:
        packaged_gguf("smollm2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("new-user")
    server = RedisServer(tmp_path_factory.mktemp("readers-redis")).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_") or k == "BATCHD_HOME"}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
    env["VIRTUAL_ENV"] = str(Path(sys.executable).parent.parent)
    env["XDG_DATA_HOME"] = str(folder / ".local-share")  # a fresh user's data folder
    env.pop("PYTHONPATH", None)  # nothing of the checkout's tests: batchd as installed
    session = Reader(folder, env, server.url, free_port())
    try:
        (daemon,) = quickstarts()["daemon"]
        session.run_block(*daemon)
        assert session.env["BATCHD_REDIS_URL"] == server.url
        yield session
    finally:
        session.stop()
        server.kill()


def test_the_readme_has_each_quickstart() -> None:
    found = quickstarts()
    assert set(found) == {"daemon", "service", "openai", "bulk"}, sorted(found)
    (daemon,) = found["daemon"]
    assert "batchd serve --model smollm2 &" in daemon[1]
    assert README_REDIS_URL in daemon[1]


def test_a_service_submits_and_streams(reader: Reader) -> None:
    """``batchd submit --stream`` and the Python client each print SmolLM2's answer."""
    (submit, *_), client = [reader.run_block(*block) for block in quickstarts()["service"]]
    assert QUESTION_ANSWER in submit, submit
    (printed,) = client
    assert QUESTION_ANSWER in printed and printed.endswith("\n"), printed


def test_an_openai_sdk_app_streams_through_the_gateway(reader: Reader) -> None:
    gateway, app = quickstarts()["openai"]
    assert reader.run_block(*gateway) == []  # the gateway runs in the background
    (printed,) = reader.run_block(*app)
    assert QUESTION_ANSWER in printed, printed


def test_a_bulk_job_writes_its_results(reader: Reader) -> None:
    (block,) = quickstarts()["bulk"]
    *_, results = reader.run_block(*block)
    lines = [json.loads(line) for line in results.splitlines()]
    assert [line["line"] for line in sorted(lines, key=lambda r: r["line"])] == [1, 2], results
    assert all(line["text"] and line["finish_reason"] for line in lines), results
    by_line = {line["line"]: line for line in lines}
    assert QUESTION_ANSWER in by_line[1]["text"], results
    assert (reader.folder / "results.jsonl").is_symlink()  # a link into the files folder
