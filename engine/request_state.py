"""Per-request output bookkeeping: positions, seeds, text and stop conditions.

The scheduler's Sequence knows tokens and blocks; this knows what a caller
sees. A resumed request (after a crash) replays its already-delivered tokens
through ``resume``: max_tokens, output positions (and so seeded sampling),
the detokenizer and the stop-string filter then stand exactly where an
uninterrupted run stood, held-back text included, so the next output carries
that text and a stop string spanning the crash point is still found. A
constrained request's grammar matcher is advanced by every token, replayed
ones included, so a resumed request is masked exactly as it would have been. A grammar's
end is enforced: its end token stops the row even with ``ignore_eos``. Under
``min_tokens`` outputs neither an end token (masked: ``banned``) nor a stop string
ends the request (vLLM's). A request penalised over its whole output keeps its
token counts here (``history``), replayed tokens included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchd.engine.constraints import RowMatcher
from batchd.engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from batchd.engine.logits_processors import PenaltyHistory
from batchd.engine.sampling_params import SamplingParams
from batchd.engine.scheduling.sequence import FinishReason


@dataclass(frozen=True)
class TokenVerdict:
    """The text a new token releases, and why the request ends with it (if it does).
    ``stop_token``: the token is a stop token (eos, stop_token_ids, a grammar's end), which
    ends the request and adds no text of its own (``text`` is only what it released)."""

    text: str
    finish_reason: FinishReason | None
    stop_token: bool = False


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
        matcher: RowMatcher | None = None,
        history: PenaltyHistory | None = None,
        special_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.num_outputs = 0
        self.max_outputs = max_outputs
        self.output_token_ids: list[int] = []
        self.text = ""
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        # A grammar ends with an end token (its mask allows one only where the grammar may
        # end): that ends the row whatever ignore_eos says, and is never emitted as text.
        self._grammar_ends = eos_token_ids if matcher is not None else frozenset()
        self.matcher = matcher
        self.history = history
        self._detok = IncrementalDetokenizer(
            tokenizer,
            special_ids=special_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self._stops = StopStringFilter(params.stop)

    def resume(self, tokens: Sequence[int]) -> FinishReason | None:
        """Replay outputs a previous run delivered (their text is ``self.text`` after).

        Returns the finish reason if they already end the request (an end token,
        a stop string, max_tokens): the uninterrupted run ended there too.
        Raises InvalidRequest if a token breaks the request's grammar.
        """
        for token_id in tokens:
            reason = self.on_token(token_id).finish_reason
            if reason is not None:
                return reason
        return None

    @property
    def banned(self) -> frozenset[int]:
        """Tokens the next output may not be: the end tokens while under min_tokens."""
        return self._stop_ids if self.num_outputs < self.params.min_tokens else frozenset()

    def banned_after(self, ahead: int) -> frozenset[int]:
        """``banned`` for the output ``ahead`` positions after the next one (speculative
        decoding samples several positions at once)."""
        if self.num_outputs + ahead < self.params.min_tokens:
            return self._stop_ids
        return frozenset()

    def on_token(self, token_id: int) -> TokenVerdict:
        """Account one sampled token; return its text and finish reason."""
        self.num_outputs += 1
        self.output_token_ids.append(token_id)
        if self.history is not None:
            self.history.add(token_id)
        if self.matcher is not None:
            self.matcher.consume(token_id)
        if token_id in self._stop_ids or token_id in self._grammar_ends:
            return self._emit(self._flush(), FinishReason.stop, stop_token=True)
        text = self._stops.push(self._detok.add(token_id), armed=self._armed)
        if self._stops.stopped:
            return self._emit(text, FinishReason.stop)
        if self.matcher is not None and self.matcher.stopped:
            return self._emit(text + self._flush(), FinishReason.stop)
        if self.num_outputs >= self.max_outputs:
            return self._emit(text + self._flush(), FinishReason.length)
        return self._emit(text, None)

    @property
    def _armed(self) -> bool:
        """Stop strings may end the request: past min_tokens outputs."""
        return self.num_outputs > self.params.min_tokens

    def _flush(self) -> str:
        text = self._stops.push(self._detok.flush(), armed=self._armed)
        return text if self._stops.stopped else text + self._stops.flush()

    def _emit(
        self, text: str, reason: FinishReason | None, *, stop_token: bool = False
    ) -> TokenVerdict:
        self.text += text
        return TokenVerdict(text, reason, stop_token)
