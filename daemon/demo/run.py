"""``batchd demo``: the whole product in under a minute on a fresh machine.

A daemon (in-process, on its own engine thread) serves the random-weight
``tiny`` model; producer threads submit jobs of different lengths through the
client SDK while others run; subscriber threads stream each job's tokens.
Everything uses a key prefix unique to the run (expiring after a few
minutes), so a shared Redis with real jobs is never disturbed. The tiny
model steps in about a millisecond, so steps are paced (``--step-ms``) to
make continuous batching visible: jobs join the batch as others leave it,
and long prompts are prefilled in chunks next to running decodes.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from config import Settings
from daemon.demo.find_redis import find_redis
from daemon.demo.view import JobLine, LiveView, step_line, summary
from daemon.worker.generator import StepView, TokenOut
from daemon.worker.loop import Worker
from producers.client import Client
from producers.errors import BatchdError

# (prompt, max_tokens): short and long prompts, short and long answers.
JOBS = [
    ("Hello!", 24),
    ("Explain continuous batching in one sentence.", 72),
    ("Summarise: " + "the quick brown fox jumps over the lazy dog; " * 12, 32),
    ("Write a haiku about queues.", 48),
    ("List three uses of Redis streams.", 96),
    ("Translate to French: " + "good morning, how are you today? " * 6, 40),
    ("Count to ten.", 16),
    ("Tell a very long story about a daemon that never loses a token.", 120),
]


def ensure_model(path: Path) -> Path:
    """The tiny fixture model, built on first use (random weights, real tokenizer)."""
    if not (path / "config.json").is_file():
        from engine.models.model_fixture import FixtureSpec, make_model

        print(f"building the tiny demo model in {path} ...", flush=True)
        make_model(path, FixtureSpec(preset="tiny"))
    return path


def demo_settings(settings: Settings, *, redis_url: str, model: Path) -> Settings:
    """The user's settings, scoped to this run: own prefix and queue, small batch."""
    prefix = f"batchd-demo-{os.getpid()}-{secrets.token_hex(3)}"
    engine = dataclasses.replace(
        settings.engine, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=256
    )
    daemon = settings.daemon.model_copy(
        update={"consumer_name": f"{prefix}-daemon", "block_ms": 100, "grace_period_s": 2.0}
    )
    return settings.model_copy(
        update={
            "redis_url": redis_url,
            "key_prefix": prefix,
            "queues": ["demo"],
            "model": str(model),
            "result_ttl_s": 300,
            "engine": engine,
            "daemon": daemon,
        }
    )


class _StepPacer:
    """The worker's step observer: counts steps, prints them, paces them."""

    def __init__(self, *, show: bool, step_s: float, names: dict[str, str]) -> None:
        self.show = show
        self.step_s = step_s
        self.names = names
        self.steps = 0

    def __call__(self, view: StepView | None, outputs: list[TokenOut]) -> None:
        self.steps += 1
        if self.show:
            print(step_line(self.steps, view, self.names), flush=True)
        time.sleep(self.step_s)


def _start_daemon(settings: Settings, pacer: _StepPacer) -> tuple[Worker, threading.Thread]:
    """The daemon on its engine thread (the model is loaded there: MLX streams are per thread)."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        from daemon.worker.mlx_generator import MLXGenerator

        try:
            generator = MLXGenerator.from_pretrained(str(settings.model), settings.engine)
            consumer = settings.daemon.consumer_name or "demo"
            box["worker"] = Worker(settings, generator, consumer=consumer, on_step=pacer)
        finally:
            ready.set()
        box["worker"].run()

    thread = threading.Thread(target=main, name="batchd-engine", daemon=True)
    thread.start()
    ready.wait()
    if "worker" not in box:
        raise RuntimeError("the demo daemon failed to start (see the log above)")
    return box["worker"], thread


def _produce(client: Client, jobs: list[tuple[str, str, int]], view: LiveView) -> None:
    """Submit jobs a little apart, each followed by a subscriber thread."""
    for job_id, prompt, max_tokens in jobs:
        client.submit(prompt, id=job_id, max_tokens=max_tokens, ignore_eos=True)
        threading.Thread(target=_subscribe, args=(client, job_id, view), daemon=True).start()
        time.sleep(0.3)


def _subscribe(client: Client, job_id: str, view: LiveView) -> None:
    try:
        for event in client.stream(job_id, timeout=120):
            if event.final:
                view.finished(job_id, event.finish_reason.value if event.finish_reason else "?")
            else:
                view.token(job_id, event.text)
    except BatchdError as exc:
        view.finished(job_id, f"error: {exc}")


def run_demo(settings: Settings, *, show_steps: bool, step_ms: float, model_dir: Path) -> int:
    found = find_redis(settings.redis_url)
    print(f"batchd demo: Redis: {found.kind} at {found.url}", flush=True)
    try:
        scoped = demo_settings(settings, redis_url=found.url, model=ensure_model(model_dir))
        run_id = secrets.token_hex(2)
        jobs = [(f"job{i}-{run_id}", p, n) for i, (p, n) in enumerate(JOBS)]
        names = {job_id: job_id.split("-")[0] for job_id, _, _ in jobs}
        lines = {j: JobLine(names[j], n) for j, _, n in jobs}
        view = LiveView(lines, redraw=sys.stdout.isatty() and not show_steps)
        pacer = _StepPacer(show=show_steps, step_s=step_ms / 1000, names=names)
        print(
            f"serving the random-weight tiny model (gibberish text, real batching): "
            f"{len(jobs)} jobs, at most {scoped.engine.max_num_seqs} running at once, "
            f"prefix {scoped.key_prefix}\n",
            flush=True,
        )
        worker, engine_thread = _start_daemon(scoped, pacer)
        started = time.monotonic()
        client = Client(found.url, prefix=scoped.key_prefix, queue="demo")
        producers = [
            threading.Thread(target=_produce, args=(client, jobs[i::2], view), daemon=True)
            for i in range(2)
        ]
        for t in producers:
            t.start()
        while any(line.finish is None for line in lines.values()) and engine_thread.is_alive():
            if time.monotonic() - started > 120:
                print("batchd demo: jobs did not finish in 120 s", file=sys.stderr)
                break
            view.draw()
            time.sleep(0.1)
        view.draw()
        elapsed = time.monotonic() - started
        worker.request_stop()
        engine_thread.join(10)
        keys = client.keys
        client.redis.delete(keys.queue("demo"), keys.cancel, keys.dead)
        client.close()
        print(
            summary(
                jobs=len(jobs),
                tokens=worker.meter.tokens,
                seconds=elapsed,
                steps=worker.meter.steps,
                batch_sizes=worker.meter.batch_sizes,
                redis_kind=found.kind,
            )
        )
        return 0 if all(line.finish for line in lines.values()) else 1
    finally:
        found.stop()
