"""Which sampled tokens a step keeps: the run of a verify chunk its proposal agrees with.

A verify chunk's rows were each drawn as if it were the only one
(batchd.engine.sampling.rows), so a sampled token is kept while it is the token proposed
at that position: the next position's logits then saw exactly the context
speculation-off decoding gives it.
The first token that differs is kept too (it is the one decoding would have drawn there)
and nothing after it. A chunk with no proposal keeps its one sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchd.engine.scheduling.schedule import ScheduledChunk


@dataclass(frozen=True)
class Accepted:
    """A step's kept tokens: ``sampled`` for Scheduler.update (by sequence id: one id, or
    a verify chunk's kept run), ``runs`` as (chunk, its first row, rows kept) in chunk
    order, and the step's proposed (``drafted``) and kept proposed (``accepted``) tokens."""

    sampled: dict[str, int | list[int]]
    runs: list[tuple[ScheduledChunk, int, int]]
    drafted: int
    accepted: int


def accept(sampling: Sequence[ScheduledChunk], ids: Sequence[int]) -> Accepted:
    """The tokens kept of the sampled ``ids`` (one per logits row, in row order) of the
    step's sampling chunks."""
    sampled: dict[str, int | list[int]] = {}
    runs: list[tuple[ScheduledChunk, int, int]] = []
    drafted = accepted = row = 0
    for c in sampling:
        n = 1
        if c.draft:
            while n <= len(c.draft) and ids[row + n - 1] == c.draft[n - 1]:
                n += 1
            sampled[c.seq.seq_id] = list(ids[row : row + n])
            drafted += len(c.draft)
            accepted += n - 1
        else:
            sampled[c.seq.seq_id] = ids[row]
        runs.append((c, row, n))
        row += c.num_logits
    return Accepted(sampled, runs, drafted, accepted)
