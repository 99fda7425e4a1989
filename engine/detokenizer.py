"""Streaming detokenization with stop strings.

Why not mlx-lm's streaming detokenizers: its BPE one drops the leading space
of the first token, so the streamed text would differ from
``tokenizer.decode(tokens)``. This one decodes a small sliding window
(vLLM's prefix/read offsets): text is released only once the window no
longer ends in an incomplete UTF-8 sequence, so a multi-byte character is
never split and the concatenated deltas equal ``tokenizer.decode`` of all
tokens.

Stop strings: text that could still be the beginning of a stop string is
held back; when one appears, the text is cut exactly before it and the stop
string itself is never emitted.

Both are pure functions of the tokens fed so far: feeding the same tokens
again rebuilds the same held-back text, which is how a resumed request
continues exactly where an uninterrupted run would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index are already released

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Release whatever is held, incomplete characters included (end of stream)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text: str = decode(self._ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(before) :]


class StopStringFilter:
    """Withholds text that might start a stop string; finds a completed one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Feed new text; return what may be emitted now. Sets ``stopped`` on a match."""
        if self.stopped or not delta:
            return ""
        if not self._stop:
            return delta
        text = self._pending + delta
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        keep = self._held_suffix(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of stream without a stop string: release the held text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
