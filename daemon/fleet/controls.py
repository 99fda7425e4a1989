"""Pause, resume and drain: what an operator asks of one daemon, and what it obeys.

The request is a hash, ``<prefix>:control:<consumer>`` (``intake`` = paused | open,
``drain`` = 0 | 1, ``at``, ``by``), written by the dashboard
(batchd.producers.dashboard.records.controls) or by hand with HSET. The heartbeat
thread reads it after each beat (one HGETALL per heartbeat interval, on the heartbeat's
own connection: nothing per step, nothing in the engine thread's pipelines), and the
engine thread obeys what was read last (batchd.daemon.worker.loop):

- **pause** (``intake`` paused): no new entry is read from the queues and no dead
  daemon's entry is claimed; the jobs held run, publish and finish as before, and
  entries already read (pending for this daemon) are still picked up.
- **resume** (``intake`` open, ``drain`` 0): intake as usual again.
- **drain** (``drain`` 1): SIGTERM's graceful stop, except that every held job gets all
  the time it needs: intake closes, the held jobs finish, the daemon leaves the group,
  resets ``drain`` to 0 (so that the next start under this name serves) and exits 0.
  A drain once begun is not undone; SIGTERM during it starts the grace period.

A pause outlives a restart under the same consumer name (the hash stays until someone
resumes). The heartbeat announces :data:`CONTROLS` and the state obeyed (``paused``,
``draining``), so the dashboard offers only these, and shows the state.

Anyone who can write to Redis can write this key. A field or a value other than those
above, a key that is no hash, or a read Redis refuses (an ACL, say) is warned about once,
naming the key and quoting a few characters at most of what it holds, and changes nothing:
an unknown value reads as serving, an unreadable key leaves the last request read in force
(also at start: the daemon starts all the same). The warning comes again only when the
problem changes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)

# The controls this daemon obeys, as the heartbeat announces them.
CONTROLS = ("pause", "resume", "drain")
# The hash's fields and the values a request may take (``at`` and ``by`` are free text).
_VALUES = {"intake": ("paused", "open"), "drain": ("0", "1")}
_FIELDS = (*_VALUES, "at", "by")
# How much of a hostile field name or value a warning quotes, and how many names.
_SHOWN_CHARS = 40
_MAX_NAMED = 5
# How much of Redis's error reply a warning quotes.
_ERROR_CHARS = 200


@dataclass(frozen=True)
class Requested:
    """The state asked of a daemon (nothing asked: serving)."""

    paused: bool = False
    drain: bool = False

    @classmethod
    def from_hash(cls, fields: Mapping[Any, Any]) -> Requested:
        """The request in a control hash as HGETALL returns it (bytes or str)."""
        return cls.parse(fields)[0]

    @classmethod
    def parse(cls, fields: Mapping[Any, Any]) -> tuple[Requested, list[str]]:
        """The request, and what in the hash is not a request (unknown fields, unknown
        values: ignored, each named shortly)."""
        text = {_text(k): _text(v) for k, v in fields.items()}
        problems = [
            f"{name} {_shown(text[name])} is not one of {', '.join(allowed)}"
            for name, allowed in _VALUES.items()
            if name in text and text[name] not in allowed
        ]
        unknown = sorted(name for name in text if name not in _FIELDS)
        if unknown:
            shown = ", ".join(_shown(name) for name in unknown[:_MAX_NAMED])
            more = f" and {len(unknown) - _MAX_NAMED} more" if len(unknown) > _MAX_NAMED else ""
            problems.append(f"unknown field(s) {shown}{more}")
        requested = cls(paused=text.get("intake") == "paused", drain=text.get("drain") == "1")
        return requested, problems


class ControlWatch:
    """The last request read of ``<prefix>:control:<consumer>``.

    :meth:`read` runs on the heartbeat thread, the engine thread reads ``requested``
    (an attribute swap: atomic)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.redis = client
        self.key = key
        self.requested = Requested()
        self._problem: str | None = None

    @property
    def paused(self) -> bool:
        return self.requested.paused

    def read(self) -> None:
        """Read the hash once. An error reply (no hash there, the read refused) leaves the
        last request read in force; it and anything in the hash that is not a request are
        warned about once (see the module doc). Raises the connection's errors."""
        try:
            fields: Any = self.redis.hgetall(self.key)
        except redis.ResponseError as exc:
            error = f"{type(exc).__name__}: {str(exc)[:_ERROR_CHARS]}"
            self._report(f"unreadable ({error}); the last request read stays")
            return
        requested, problems = Requested.parse(fields)
        self._report("; ".join(problems) + "; ignored" if problems else None)
        if requested != self.requested:
            log.info(
                "control %s: intake %s%s",
                self.key,
                "paused" if requested.paused else "open",
                ", drain requested" if requested.drain else "",
                extra={"event": "control", "paused": requested.paused, "drain": requested.drain},
            )
        self.requested = requested

    def _report(self, problem: str | None) -> None:
        """Warn of ``problem`` unless it is the one warned of last; say when it is gone."""
        if problem == self._problem:
            return
        if problem is not None:
            log.warning("control %s: %s", self.key, problem, extra={"event": "control"})
        else:
            log.info("control %s: readable again", self.key, extra={"event": "control"})
        self._problem = problem

    def drained(self) -> None:
        """The drain is done: reset ``drain`` so that the next start serves (a failure is
        logged: that start then drains at once, with nothing held)."""
        try:
            self.redis.hset(self.key, "drain", "0")
        except redis.RedisError as exc:
            log.warning("could not reset the drain request %s: %s", self.key, exc)


class Stop:
    """When the loop ends: not yet; at a deadline (SIGTERM's grace period); or, for a
    drain, once no job is held."""

    def __init__(self) -> None:
        self.stopping = False
        self.draining = False
        self.deadline = math.inf

    def request(self, *, drain: bool, grace_s: float) -> bool:
        """First call: stop with ``grace_s`` (a drain: no deadline); True. Later calls
        (False): SIGTERM during a drain starts the grace period, a second SIGTERM ends
        the wait now; a drain asked while stopping changes nothing."""
        if self.stopping:
            if not drain:
                self.deadline = 0.0 if self.deadline < math.inf else time.monotonic() + grace_s
            return False
        self.stopping, self.draining = True, drain
        self.deadline = math.inf if drain else time.monotonic() + grace_s
        return True

    def done(self, *, holding: bool) -> bool:
        """Stopping, and no job is held or the deadline passed."""
        return self.stopping and (not holding or time.monotonic() >= self.deadline)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _shown(text: str) -> str:
    """``text`` quoted, cut to a few characters (a hostile value may be megabytes)."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"
