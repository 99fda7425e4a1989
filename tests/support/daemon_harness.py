"""Helpers of the daemon tests: a deterministic fake engine, in-thread and subprocess
daemons, and checks on what Redis holds for a job."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from batchd.config.settings import Settings, load_settings
from batchd.daemon.worker.generator import Generator, JobRejected, JobStart
from batchd.daemon.worker.loop import Worker
from batchd.engine.outputs import ChunkKind, ChunkStat, FinishReason, RequestOutput, StepStats
from batchd.producers.keys import EVENT_FIELD, JOB_FIELD, Keys, seq_of
from batchd.producers.schema import Event, JobRequest, JobStatus, job_seed

ROOT = Path(__file__).resolve().parents[2]
# Token ids an uninterrupted in-process run gives each job dict (the `reference` fixture).
Reference = Callable[[list[dict[str, Any]]], dict[str, list[int]]]


def fast_settings(redis_url: str, **daemon: Any) -> Settings:
    """Settings with the short intervals the tests need (overridable per test)."""
    opts: dict[str, Any] = {
        "heartbeat_interval_s": 0.1,
        "heartbeat_ttl_s": 0.5,
        "claim_interval_s": 0.1,
        "block_ms": 100,
        "grace_period_s": 5.0,
        "redis_retry_max_s": 0.2,
    }
    opts.update(daemon)
    return load_settings(redis_url=redis_url, daemon=opts, log_level="DEBUG")


# -- a deterministic engine without MLX ------------------------------------------------------


def token_output(
    job_id: str,
    token_id: int,
    text: str,
    *,
    index: int,
    finish: FinishReason | None = None,
    error: str | None = None,
) -> RequestOutput:
    """An engine output of a fake engine: token ``index`` of a job (its request)."""
    return RequestOutput(
        request_id=job_id,
        token_id=token_id,
        text=text,
        logprob=-1.0,
        index=index,
        finished=finish is not None,
        finish_reason=finish,
        error=error,
    )


def step_stats(
    step: int, *, decodes: Sequence[str] = (), prefills: Sequence[tuple[str, int]] = ()
) -> StepStats:
    """A fake engine step's figures: its decodes and prefill chunks (job id, tokens)."""
    chunks = [ChunkStat(j, ChunkKind.decode, 0, 1) for j in decodes]
    chunks += [ChunkStat(j, ChunkKind.prefill, 0, n) for j, n in prefills]
    prefill = sum(n for _, n in prefills)
    return StepStats(
        step=step,
        num_scheduled_tokens=len(decodes) + prefill,
        num_prefill_tokens=prefill,
        num_decode_tokens=len(decodes),
        num_seqs=len(chunks),
        chunks=chunks,
    )


def fake_token(prompt: Sequence[int], seed: int | None, position: int) -> int:
    """The fake engine's token at an output position: a pure function, like seeded sampling."""
    return (sum(prompt) * 31 + position * 7 + (seed or 0)) % 97 + 3


@dataclass
class _FakeSeq:
    job_id: str
    prompt: list[int]
    seed: int | None
    max_tokens: int
    outputs: list[int]
    prefilled: bool = False


@dataclass
class FakeGenerator(Generator):
    """Runs up to ``max_running`` jobs; each step, every running job gets one token.

    Token ids come from :func:`fake_token`, text is ``"<id> "``, jobs end at
    max_tokens. ``step_delay_s`` makes steps slow enough to act mid-job.
    """

    max_running: int = 8
    step_delay_s: float = 0.0
    steps_use_cpu: bool = False
    running: list[_FakeSeq] = field(default_factory=list)
    waiting: list[_FakeSeq] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    _stats: StepStats = field(default_factory=lambda: StepStats(step=0))

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        text = request.prompt or " ".join(m.content for m in request.messages or [])
        if not text:
            raise JobRejected(job_id, "prompt: empty after tokenizing")
        return [ord(c) % 256 for c in text]

    def start(self, job: JobStart) -> FinishReason | None:
        seed, max_tokens = job.request.seed, job.request.max_tokens
        if seed == job_seed(job.job_id):
            seed = None  # the seed every unseeded job gets: its fake tokens stay as before
        if len(job.emitted) >= max_tokens:
            return FinishReason.length
        self.started.append(job.job_id)
        self.waiting.append(
            _FakeSeq(job.job_id, job.prompt_token_ids, seed, max_tokens, list(job.emitted))
        )
        return None

    def abort(self, job_id: str) -> None:
        self.aborted.append(job_id)
        self.running = [s for s in self.running if s.job_id != job_id]
        self.waiting = [s for s in self.waiting if s.job_id != job_id]

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        prefills = [(s.job_id, len(s.prompt)) for s in self.running if not s.prefilled]
        decodes = [s.job_id for s in self.running if s.prefilled]
        outs = []
        for seq in list(self.running):
            seq.prefilled = True
            index = len(seq.outputs)
            token = fake_token(seq.prompt, seq.seed, index)
            seq.outputs.append(token)
            done = len(seq.outputs) >= seq.max_tokens
            if done:
                self.running.remove(seq)
            finish = FinishReason.length if done else None
            outs.append(token_output(seq.job_id, token, f"{token} ", index=index, finish=finish))
        self._stats = step_stats(self._stats.step + 1, decodes=decodes, prefills=prefills)
        return outs

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> StepStats:
        """The last step's batch; the load as it is now."""
        running, waiting = len(self.running), len(self.waiting)
        return dataclasses.replace(self._stats, num_running=running, num_waiting=waiting)


def expected_fake_tokens(prompt: Sequence[int], seed: int | None, max_tokens: int) -> list[int]:
    return [fake_token(prompt, seed, i) for i in range(max_tokens)]


# -- daemons ------------------------------------------------------------------------------------


@contextmanager
def worker_thread(
    settings: Settings,
    make_generator: Callable[[], Generator],
    *,
    consumer: str = "test-worker",
) -> Iterator[Worker]:
    """A Worker running on its own thread (the generator is built on that thread, as MLX
    requires); stopped (SIGTERM-like) and joined on exit."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["worker"] = Worker(settings, make_generator(), consumer=consumer)
        finally:
            ready.set()
        box["worker"].run()

    thread = threading.Thread(target=main, name=f"worker-{consumer}", daemon=True)
    thread.start()
    ready.wait(60)
    worker: Worker = box["worker"]
    # Serving once the heartbeat beats (it starts after the groups exist).
    wait_until(worker.heartbeat._thread.is_alive, timeout=30, what="worker serving")
    try:
        yield worker
    finally:
        worker.request_stop()
        worker.request_stop()
        thread.join(30)
        assert not thread.is_alive(), "worker did not stop"


class DaemonProcess:
    """``batchd serve`` in a subprocess with a TOML config and extra environment;
    ``faults`` (options of :mod:`support.faulty_serve`, e.g. ``["--crash", "decode:3"]``)
    serve it with a fault built in."""

    def __init__(
        self,
        config: Path,
        *,
        model: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        consumer: str | None = None,
        extra_args: Sequence[str] = (),
        faults: Sequence[str] = (),
    ) -> None:
        args = [sys.executable, "-m", "batchd.daemon.cli"]
        if faults:
            args = [sys.executable, "-m", "support.faulty_serve", *faults, "--"]
        args += ["--config", str(config), "serve", "--model", str(model), *extra_args]
        if consumer:
            args += ["--consumer-name", consumer]
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in wait()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
        if faults:  # the fault module lives beside this one
            full_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p
            )
        full_env.update(env or {})
        # Run from the test's own folder: the daemon must not need the checkout's.
        self.proc = subprocess.Popen(
            args, cwd=log_path.parent, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_serving(self, timeout: float = 60) -> DaemonProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b"serving queues" in self.log_path.read_bytes():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"daemon not serving; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()


def write_config(path: Path, settings: Settings) -> Path:
    """A TOML file equivalent to ``settings`` (for subprocess daemons)."""
    data = settings.model_dump(mode="json", exclude_none=True)
    lines: list[str] = []
    sections = {k: v for k, v in data.items() if isinstance(v, dict)}
    for key, value in data.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {orjson.dumps(value).decode()}")
    for name, section in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {orjson.dumps(v).decode()}" for k, v in section.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- what Redis holds -----------------------------------------------------------------------


def enqueue(client: redis.Redis, keys: Keys, job: dict[str, Any], *, queue: str = "default") -> str:
    """Raw XADD of a job payload (as any producer would); returns the entry id."""
    entry: bytes = client.xadd(keys.queue(queue), {JOB_FIELD: orjson.dumps(job)})
    return entry.decode()


def events_of(client: redis.Redis, keys: Keys, job_id: str) -> list[Event]:
    """The job's stored events, checked to be seq 0..n-1 with ids 0-<seq+1>."""
    entries: Any = client.xrange(keys.events(job_id))
    events = [Event.decode(fields[EVENT_FIELD.encode()]) for _, fields in entries]
    assert [seq_of(entry_id) for entry_id, _ in entries] == list(range(len(events)))
    assert [e.seq for e in events] == list(range(len(events))), f"job {job_id}: seq gap/dup"
    assert all(not e.final for e in events[:-1]), f"job {job_id}: final event before the end"
    return events


def wait_final(
    client: redis.Redis, keys: Keys, job_ids: Sequence[str], *, timeout: float = 60
) -> dict[str, list[Event]]:
    """Wait until every job's stream ends with a final event; their events."""
    deadline = time.monotonic() + timeout
    done: dict[str, list[Event]] = {}
    while time.monotonic() < deadline:
        for job_id in job_ids:
            if job_id not in done:
                last: Any = client.xrevrange(keys.events(job_id), count=1)
                if last and Event.decode(last[0][1][EVENT_FIELD.encode()]).final:
                    done[job_id] = events_of(client, keys, job_id)
        if len(done) == len(job_ids):
            return done
        time.sleep(0.05)
    missing = [j for j in job_ids if j not in done]
    raise AssertionError(f"{len(missing)} job(s) not finished in {timeout}s: {missing[:5]}")


@dataclass(frozen=True)
class CrashRun:
    """A job run by a daemon killed at a decode step, then by a restarted one."""

    at_crash: list[Event]  # what the killed daemon had stored
    events: list[Event]  # every event once the restarted daemon finished the job
    restarted_log: str


def crash_then_resume(
    redis_url: str, job: dict[str, Any], *, cut: int, model: Path, log_dir: Path
) -> CrashRun:
    """Enqueue ``job``; a daemon SIGKILLs itself at decode step ``cut`` (tokens 0..cut-1
    published), a restarted daemon finishes it and is stopped with SIGTERM."""
    client = redis.Redis.from_url(redis_url)
    keys = Keys()
    # Every step published, so that the killed daemon stored exactly tokens 0..cut-1.
    config = daemon_config(log_dir, redis_url, publish_interval_ms=0)
    enqueue(client, keys, job)
    crashed = DaemonProcess(
        config, model=model, log_path=log_dir / "crashed.log", faults=["--crash", f"decode:{cut}"]
    )
    assert crashed.wait(60) == -signal.SIGKILL, crashed.log_tail()
    at_crash = events_of(client, keys, job["id"])
    restarted = DaemonProcess(config, model=model, log_path=log_dir / "restarted.log")
    try:
        events = wait_final(client, keys, [job["id"]])[job["id"]]
    finally:
        restarted.signal(signal.SIGTERM)
        assert restarted.wait(30) == 0, restarted.log_tail()
    return CrashRun(at_crash, events, restarted.log_path.read_text())


def status_of(client: redis.Redis, keys: Keys, job_id: str) -> JobStatus:
    raw: Any = client.hgetall(keys.job(job_id))
    return JobStatus.from_hash(raw)


def token_ids(events: list[Event]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def wait_heartbeat(redis_url: str, consumer: str = "*", *, timeout: float = 10) -> None:
    """Until the heartbeat of daemon ``consumer`` (or of any daemon) is in Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        pattern = f"batchd:daemon:{consumer}"
        wait_until(lambda: bool(client.keys(pattern)), timeout=timeout, what="a heartbeat")
    finally:
        client.close()


def wait_until(predicate: Callable[[], bool], *, timeout: float = 10, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


# -- jobs for the real engine ---------------------------------------------------------------


def drain(eng: Any) -> tuple[list[int], list[str]]:
    """Step an engine (an engine.LLMEngine) until it is idle: every output's token and text."""
    tokens, texts = [], []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.append(out.token_id)
            texts.append(out.text)
    return tokens, texts


# Small enough that 30 jobs need many steps (preemption-free: the pool fits them all).
ENGINE_OPTS: dict[str, Any] = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "num_kv_blocks": 512,
}


def mixed_jobs(
    n: int, *, prefix: str, seed: int = 0, max_tokens: tuple[int, int] = (4, 40)
) -> list[dict[str, Any]]:
    """``n`` jobs of mixed prompt and output lengths; even ones greedy, odd ones seeded."""
    import random

    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        job: dict[str, Any] = {
            "id": f"{prefix}{i}",
            "prompt_token_ids": [rng.randrange(3, 1000) for _ in range(rng.randint(3, 150))],
            "max_tokens": rng.randint(*max_tokens),
        }
        if i % 2:
            job.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        jobs.append(job)
    return jobs


def daemon_config(
    tmp: Path, redis_url: str, *, limits: dict[str, Any] | None = None, **daemon: Any
) -> Path:
    """A config file for subprocess daemons: fast intervals, the test engine options."""
    settings = fast_settings(redis_url, **daemon)
    for key, value in ENGINE_OPTS.items():
        setattr(settings.engine, key, value)
    for key, value in (limits or {}).items():
        setattr(settings.limits, key, value)
    settings.log_level = "INFO"
    return write_config(tmp / "batchd.toml", settings)
