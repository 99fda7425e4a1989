"""Streaming detokenization with stop strings.

Why not mlx-lm's streaming detokenizers: its BPE one drops the leading space
of the first token, so the streamed text would differ from
``tokenizer.decode(tokens)``. This one decodes a small sliding window
(vLLM's prefix/read offsets): text is released only once the window no
longer ends in an incomplete UTF-8 sequence, so a multi-byte character is
never split and the concatenated deltas equal ``tokenizer.decode`` of all
tokens.

Special tokens (vLLM's options and defaults): with ``skip_special_tokens`` they
never enter the text (as ``decode(..., skip_special_tokens=True)``, which drops them
before decoding); kept, with ``spaces_between_special_tokens`` each is a segment of its
own and the segments are joined with a space, as vLLM's and Hugging Face's Python
detokenizers join them (``"Paris. <|im_end|>"``); without it the text is the
tokenizer's own decode of every token (``"Paris.<|im_end|>"``). "Special" is what the
tokenizer marks so: its special ids and its added tokens flagged special.

Stop strings: text that could still be the beginning of a stop string is
held back; when one appears, the text is cut exactly before it and the stop
string itself is never emitted. Before ``min_tokens`` outputs a stop string does
not stop (vLLM's): it stays in the text.

Both are pure functions of the tokens fed so far: feeding the same tokens
again rebuilds the same held-back text, which is how a resumed request
continues exactly where an uninterrupted run would be.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a tokenizer marks special: its special ids (bos, eos, unk, pad, additional
    special tokens) and its added tokens flagged special (chat markers)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


class TokenTexts:
    """Each token id's own text, decoded alone (special tokens as written), cached: what
    logprobs name tokens by for a client without the tokenizer.

    A token that is only part of a multi-byte character decodes alone to U+FFFD, which
    is not its bytes; :meth:`bytes_of` gives such a token's own bytes, so a client can join
    consecutive tokens' bytes into the character (OpenAI's logprobs ``bytes``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self._pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes | None] = {}

    def of(self, ids: Iterable[int]) -> dict[int, str]:
        """``{id: text}`` for each of ``ids``."""
        out = {}
        for token_id in ids:
            text = self._texts.get(token_id)
            if text is None:
                text = self._texts[token_id] = str(self._decode([token_id]))
            out[token_id] = text
        return out

    def bytes_of(self, ids: Iterable[int]) -> dict[int, bytes]:
        """``{id: its bytes}`` for each of ``ids`` whose text (:meth:`of`) is not its bytes'
        UTF-8: a part of a multi-byte character. Other ids are left out (their text's UTF-8
        is their bytes), as is one whose bytes the tokenizer does not tell."""
        out = {}
        for token_id, text in self.of(ids).items():
            if _INCOMPLETE not in text:
                continue
            if token_id not in self._bytes:
                self._bytes[token_id] = self._raw(token_id, text)
            raw = self._bytes[token_id]
            if raw is not None:
                out[token_id] = raw
        return out

    def _raw(self, token_id: int, text: str) -> bytes | None:
        """The token's bytes from its vocabulary entry: a byte-fallback ``<0xE2>`` piece's
        byte, or a byte-level BPE piece mapped back through GPT-2's byte alphabet; kept
        only when they decode (invalid bytes replaced) to the token's text, else None."""
        if self._pieces is None:
            return None
        piece = str(self._pieces(token_id))
        fallback = _BYTE_PIECE.fullmatch(piece)
        if fallback is not None:
            raw = bytes([int(fallback.group(1), 16)])
        elif all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
        else:
            return None
        same = raw.decode("utf-8", "replace") == text and raw != text.encode()
        return raw if same else None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (special tokens as the module
    doc says)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        special_ids: frozenset[int] = frozenset(),
        skip_special_tokens: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index are already released
        self._special = special_ids
        self._skip = skip_special_tokens
        self._segments = spaces_between_special_tokens and not skip_special_tokens
        self._emitted = False  # some text went out
        self._space = False  # a segment ended since: the next text starts with a space

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        if token_id in self._special:
            if self._skip:
                return ""
            if self._segments:
                return self._special_segment(token_id)
        self._ids.append(token_id)
        return self._out(self._release(final=False))

    def flush(self) -> str:
        """Release whatever is held, incomplete characters included (end of stream)."""
        return self._out(self._release(final=True))

    def _special_segment(self, token_id: int) -> str:
        """End the text segment, then the special token as a segment of its own."""
        text = self._out(self._release(final=True))
        self._ids, self._prefix, self._read = [], 0, 0
        self._space = self._emitted
        text += self._out(self._tokenizer.decode([token_id]))
        self._space = self._emitted
        return text

    def _out(self, text: str) -> str:
        if not text:
            return ""
        if self._space:
            text, self._space = " " + text, False
        self._emitted = True
        return text

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

    def push(self, delta: str, *, armed: bool = True) -> str:
        """Feed new text; return what may be emitted now. Sets ``stopped`` on a match,
        unless not ``armed`` (under min_tokens): then a stop string is plain text."""
        if self.stopped or not delta:
            return ""
        if not self._stop:
            return delta
        text = self._pending + delta
        cut = -1
        if armed:
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
