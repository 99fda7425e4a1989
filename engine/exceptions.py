"""The engine's errors: a request's fault (reject it) versus the engine's or the model's.

A caller that serves untrusted requests (the daemon) turns :class:`InvalidRequest`
into a rejection of that request and treats anything else as a failure of its
own, so a bug is never blamed on a job. All are ``ValueError`` subclasses where
the old plain ``ValueError`` was raised, so existing callers keep working.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's own errors."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine can never run as given: its prompt, ids or sampling values."""


class RequestRejected(InvalidRequest):
    """A request too long for the model, the KV pool or one step's budget."""


class UnsupportedModelError(EngineError, ValueError):
    """The checkpoint's architecture or file format is not one the engine implements."""
