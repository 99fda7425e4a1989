"""Per-request output bookkeeping: positions, seeds, text and stop conditions.

The scheduler's Sequence knows tokens and blocks; this knows what a caller
sees. A resumed request (after a crash) is given its already-emitted tokens:
they join the prompt for the scheduler, but here they count as outputs, so
max_tokens, output positions (and so seeded sampling) and the detokenizer
all continue where they stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenVerdict:
    """The text a new token releases, and why the request ends with it (if it does)."""

    text: str
    finish_reason: str | None


class RequestState:
    """Output-side state of one live request."""

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        seed: int,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        max_outputs: int,
        resumed_tokens: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.num_outputs = len(resumed_tokens)
        self.max_outputs = max_outputs
        self.output_token_ids: list[int] = list(resumed_tokens)
        self.text = ""
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self._detok = IncrementalDetokenizer(tokenizer, resumed_tokens)
        self._stops = StopStringFilter(params.stop)

    def on_token(self, token_id: int) -> TokenVerdict:
        """Account one sampled token; return its text and finish reason."""
        self.num_outputs += 1
        self.output_token_ids.append(token_id)
        if token_id in self._stop_ids:
            return self._emit(self._flush(), "stop")
        text = self._stops.push(self._detok.add(token_id))
        if self._stops.stopped:
            return self._emit(text, "stop")
        if self.num_outputs >= self.max_outputs:
            return self._emit(text + self._flush(), "length")
        return self._emit(text, None)

    def _flush(self) -> str:
        text = self._stops.push(self._detok.flush())
        return text if self._stops.stopped else text + self._stops.flush()

    def _emit(self, text: str, reason: str | None) -> TokenVerdict:
        self.text += text
        return TokenVerdict(text, reason)
