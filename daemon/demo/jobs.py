"""The jobs ``batchd demo`` submits: chat questions for a real model, filler for random weights.

Both sets mix short and long prompts with short and long answers, so jobs
join and leave the batch at different steps and long prompts are prefilled
in chunks next to running decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DemoJob:
    """One demo job: a short name for the live view, its input and its token budget."""

    name: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] = ()

    @property
    def question(self) -> str:
        """What the job asks, as the transcript shows it (the last user turn)."""
        return self.messages[-1][1] if self.messages else self.prompt or ""

    def submit_args(self) -> dict[str, Any]:
        """Keyword arguments of Client.submit for this job's input."""
        if self.messages:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages]}
        return {"prompt": self.prompt}


_REDIS_NOTE = (
    "Redis Streams are an append-only log data type. Producers add entries with XADD; "
    "consumer groups let several workers share a stream, each entry delivered to one "
    "consumer, which acknowledges it with XACK once processed. Entries that were delivered "
    "but never acknowledged stay in the pending entries list, so another consumer can claim "
    "them with XAUTOCLAIM after a crash."
)

# Real questions for an instruct model (greedy, ending at the model's end of turn).
CHAT_JOBS = [
    DemoJob("capital", 32, messages=(("user", "What is the capital of France?"),)),
    DemoJob("sky", 80, messages=(("user", "Explain in two sentences why the sky is blue."),)),
    DemoJob("haiku", 48, messages=(("user", "Write a haiku about the ocean."),)),
    DemoJob("health", 120, messages=(("user", "Give three short tips for staying healthy."),)),
    DemoJob(
        "ocean",
        40,
        messages=(
            ("system", "You are a concise assistant. Answer in one sentence."),
            ("user", "What is the largest ocean on Earth?"),
        ),
    ),
    DemoJob("cpu", 40, messages=(("user", "What does a CPU do? Answer in one sentence."),)),
    DemoJob("python", 96, messages=(("user", "What is the Python language used for?"),)),
    DemoJob("summary", 64, messages=(("user", f"Summarise in one sentence: {_REDIS_NOTE}"),)),
]

# Filler for random-weight models (the text is gibberish; the batching is real).
FILLER_JOBS = [
    DemoJob("job0", 24, prompt="Hello!"),
    DemoJob("job1", 72, prompt="Explain continuous batching in one sentence."),
    DemoJob(
        "job2", 32, prompt="Summarise: " + "the quick brown fox jumps over the lazy dog; " * 12
    ),
    DemoJob("job3", 48, prompt="Write a haiku about queues."),
    DemoJob("job4", 96, prompt="List three uses of Redis streams."),
    DemoJob("job5", 40, prompt="Translate to French: " + "good morning, how are you today? " * 6),
    DemoJob("job6", 16, prompt="Count to ten."),
    DemoJob("job7", 120, prompt="Tell a very long story about a daemon that never loses a token."),
]
