"""What ``batchd demo`` shows: a live line per job, engine steps, and a summary.

On a terminal each job's line is redrawn in place (ANSI cursor moves); when
stdout is a pipe or a file, or with ``--show-steps``, plain lines are
printed instead: one per job every PLAIN_EVERY tokens and when it ends, so
a log of the run stays readable.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

from batchd.engine.outputs import ChunkKind, StepStats

PLAIN_EVERY = 16


def _text_width() -> int:
    """Room left for a job's text after its name, bar and count on this terminal."""
    return max(24, shutil.get_terminal_size((100, 24)).columns - 46)


@dataclass
class JobLine:
    job_id: str
    max_tokens: int
    tokens: int = 0
    text: str = ""
    finish: str | None = None
    shown: tuple[int, str | None] = (0, None)

    def render(self) -> str:
        width = 20
        filled = width * self.tokens // max(self.max_tokens, 1)
        bar = "#" * filled + "." * (width - filled)
        tail = self.text.replace("\n", " ").replace("\r", " ")[-_text_width() :]
        end = f" [{self.finish}]" if self.finish else ""
        return f"{self.job_id:<8} [{bar}] {self.tokens:>3}/{self.max_tokens:<3} {tail!r}{end}"


@dataclass
class LiveView:
    """Thread-safe: subscriber threads add tokens, the main thread draws."""

    lines: dict[str, JobLine]
    out: TextIO = sys.stdout
    redraw: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    _drawn: int = 0

    def token(self, job_id: str, text: str) -> None:
        with self.lock:
            line = self.lines[job_id]
            line.tokens += 1
            line.text += text

    def finished(self, job_id: str, reason: str) -> None:
        with self.lock:
            self.lines[job_id].finish = reason

    def draw(self) -> None:
        with self.lock:
            if self.redraw:
                if self._drawn:
                    self.out.write(f"\x1b[{self._drawn}F")
                for line in self.lines.values():
                    self.out.write("\x1b[2K" + line.render() + "\n")
                self._drawn = len(self.lines)
            else:
                for line in self.lines.values():
                    shown_tokens, shown_finish = line.shown
                    due = line.tokens >= shown_tokens + PLAIN_EVERY
                    if due or line.finish != shown_finish:
                        self.out.write(line.render() + "\n")
                        line.shown = (line.tokens, line.finish)
            self.out.flush()


def step_line(number: int, stats: StepStats, names: dict[str, str]) -> str:
    """One engine step as a line: who decodes, who prefills how many tokens, who was preempted."""
    decodes = " ".join(
        names.get(c.request_id, c.request_id) for c in stats.chunks if c.kind is ChunkKind.decode
    )
    prefills = " ".join(
        f"{names.get(c.request_id, c.request_id)}({c.num_tokens})"
        for c in stats.chunks
        if c.kind is ChunkKind.prefill
    )
    text = f"step {number:>4} | {stats.num_scheduled_tokens:>3} tok"
    text += f" | decode: {decodes or '-'} | prefill: {prefills or '-'}"
    if stats.preempted:
        text += " | preempted: " + " ".join(names.get(j, j) for j in stats.preempted)
    return text


def transcript(answers: list[tuple[str, JobLine]]) -> str:
    """Every question with its whole answer, wrapped: what the live lines showed in part."""
    width = min(100, shutil.get_terminal_size((100, 24)).columns) - 4
    parts, pad = ["\nanswers:"], "    "
    for question, line in answers:
        parts.append(f"\n[{line.job_id}] Q: {textwrap.shorten(question, width - 8)}")
        for paragraph in line.text.strip().splitlines() or [""]:
            parts.append(textwrap.fill(paragraph, width, initial_indent=pad, subsequent_indent=pad))
    return "\n".join(parts)


def summary(
    *,
    jobs: int,
    tokens: int,
    seconds: float,
    steps: int,
    batch_sizes: Counter[int],
    redis_kind: str,
) -> str:
    sizes = ", ".join(f"{size}:{count}" for size, count in sorted(batch_sizes.items()))
    return (
        f"\n{jobs} jobs, {tokens} tokens in {seconds:.1f}s = {tokens / max(seconds, 1e-9):.0f} "
        f"tokens/s over {steps} engine steps (Redis: {redis_kind})\n"
        f"batch sizes seen (sequences per step: steps): {sizes}\n"
    )
