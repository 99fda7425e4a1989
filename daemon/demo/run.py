"""``batchd demo``: the whole product in about a minute on a fresh machine.

A daemon (in-process, on its own engine thread) serves a model, by default
the real SmolLM2-135M-Instruct; producer threads submit chat questions of
different lengths through the client SDK while others run; subscriber
threads stream each job's answer. Everything uses a key prefix unique to the
run (expiring after a few minutes), so a shared Redis with real jobs is never
disturbed. With a random-weight preset (``--preset tiny``) the text is
gibberish and a step takes about a millisecond, so steps are paced
(``--step-ms``) to make continuous batching visible: jobs join the batch as
others leave it, and long prompts are prefilled in chunks next to decodes.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.config.secrets import redact
from batchd.config.sentinel import SentinelSettings
from batchd.config.settings import Settings
from batchd.daemon.demo.find_redis import find_redis
from batchd.daemon.demo.jobs import CHAT_JOBS, FILLER_JOBS, DemoJob
from batchd.daemon.demo.view import JobLine, LiveView, step_line, summary, transcript
from batchd.daemon.worker.loop import Worker
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.producers.client import Client
from batchd.producers.errors import BatchdError

JOB_TIMEOUT_S = 300  # a real model on two CPU cores answers eight questions in about a minute


@dataclass(frozen=True)
class DemoModel:
    """What the demo serves: the directory, a label, and whether its weights are random."""

    path: Path
    label: str
    random_weights: bool


def ensure_model(*, preset: str | None, model: str | None, model_dir: Path | None) -> DemoModel:
    """The demo's model: a preset (default smollm2) built or converted into ``model_dir``
    on first use, or any ``--model`` (directory, hub id, .gguf), taken as a real model."""
    from batchd.engine.cache import model_cache
    from batchd.engine.models.registry import (
        FIXTURE_PRESETS,
        ensure_preset,
        resolve_model,
    )

    if model is not None:
        return DemoModel(Path(resolve_model(model)), model, random_weights=False)
    name = preset or "smollm2"
    target = model_dir or model_cache() / name
    if not (target / "config.json").is_file():
        print(f"preparing the {name} model in {target} (once) ...", flush=True)
    path = ensure_preset(name, path=target)
    return DemoModel(path, name, random_weights=name in FIXTURE_PRESETS)


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
            "redis_url": redis_url,  # the configured Sentinel's URL too, when it answered
            "sentinel": SentinelSettings(),
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

    def __call__(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        self.steps += 1
        if self.show:
            print(step_line(self.steps, stats, self.names), flush=True)
        time.sleep(self.step_s)


def _start_daemon(settings: Settings, pacer: _StepPacer) -> tuple[Worker, threading.Thread]:
    """The daemon on its engine thread (the model is loaded there: MLX streams are per thread)."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        from batchd.daemon.worker.mlx_generator import MLXGenerator

        try:
            generator = MLXGenerator.from_pretrained(str(settings.model), settings.engine)
            consumer = settings.daemon.consumer_name or "demo"
            box["worker"] = Worker(settings, generator, consumer=consumer, on_step=pacer)
        finally:
            ready.set()
        try:
            box["worker"].run()
        finally:
            # MLX streams must be destroyed by the thread that made them: left to process
            # exit, their teardown sometimes aborts ("terminate called without an active
            # exception", exit 134) after the demo has finished.
            import mlx.core as mx

            mx.clear_streams()

    thread = threading.Thread(target=main, name="batchd-engine", daemon=True)
    thread.start()
    ready.wait()
    if "worker" not in box:
        raise RuntimeError("the demo daemon failed to start (see the log above)")
    return box["worker"], thread


def _produce(
    client: Client, jobs: list[tuple[str, DemoJob]], view: LiveView, *, real: bool
) -> None:
    """Submit jobs a little apart, each followed by a subscriber thread.

    A real model answers greedily and stops at its end of turn; random
    weights never say end of turn meaningfully, so they run to max_tokens."""
    for job_id, job in jobs:
        options: dict[str, Any] = {"temperature": 0.0} if real else {"ignore_eos": True}
        client.submit(id=job_id, max_tokens=job.max_tokens, **job.submit_args(), **options)
        threading.Thread(target=_subscribe, args=(client, job_id, view), daemon=True).start()
        time.sleep(0.3)


def _subscribe(client: Client, job_id: str, view: LiveView) -> None:
    try:
        for event in client.stream(job_id, timeout=JOB_TIMEOUT_S):
            if event.final:
                view.finished(job_id, event.finish_reason.value if event.finish_reason else "?")
            else:
                view.token(job_id, event.text)
    except BatchdError as exc:
        view.finished(job_id, f"error: {exc}")


def run_demo(
    settings: Settings,
    *,
    show_steps: bool,
    step_ms: float | None,
    preset: str | None = None,
    model: str | None = None,
    model_dir: Path | None = None,
) -> int:
    found = find_redis(settings.connection_url())
    print(f"batchd demo: Redis: {found.kind} at {redact(found.url)}", flush=True)
    try:
        served = ensure_model(preset=preset, model=model, model_dir=model_dir)
        scoped = demo_settings(settings, redis_url=found.url, model=served.path)
        run_id = secrets.token_hex(2)
        demo_jobs = FILLER_JOBS if served.random_weights else CHAT_JOBS
        jobs = [(f"{job.name}-{run_id}", job) for job in demo_jobs]
        names = {job_id: job.name for job_id, job in jobs}
        lines = {j: JobLine(names[j], job.max_tokens) for j, job in jobs}
        view = LiveView(lines, redraw=sys.stdout.isatty() and not show_steps)
        # Random weights step in about a millisecond: pace them to make batching watchable.
        pause_ms = step_ms if step_ms is not None else (25.0 if served.random_weights else 0.0)
        pacer = _StepPacer(show=show_steps, step_s=pause_ms / 1000, names=names)
        what = (
            f"the random-weight {served.label} model (gibberish text, real batching)"
            if served.random_weights
            else f"{served.label}, answering chat questions"
        )
        print(
            f"serving {what}: {len(jobs)} jobs, at most {scoped.engine.max_num_seqs} running "
            f"at once, prefix {scoped.key_prefix}\n",
            flush=True,
        )
        worker, engine_thread = _start_daemon(scoped, pacer)
        started = time.monotonic()
        client = Client(found.url, prefix=scoped.key_prefix, queue="demo")
        real = not served.random_weights
        producers = [
            threading.Thread(
                target=_produce, args=(client, jobs[i::2], view), kwargs={"real": real}, daemon=True
            )
            for i in range(2)
        ]
        for t in producers:
            t.start()
        while any(line.finish is None for line in lines.values()) and engine_thread.is_alive():
            if time.monotonic() - started > JOB_TIMEOUT_S:
                print(f"batchd demo: jobs did not finish in {JOB_TIMEOUT_S} s", file=sys.stderr)
                break
            view.draw()
            time.sleep(0.1)
        view.draw()
        elapsed = time.monotonic() - started
        worker.request_stop()
        engine_thread.join(10)
        keys = client.keys
        client.redis.delete(
            *keys.queue_partitions("demo"), *keys.cancel_streams(), *keys.dead_streams()
        )
        client.close()
        if real:
            print(transcript([(job.question, lines[j]) for j, job in jobs]))
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
