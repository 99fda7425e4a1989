"""The Redis keys the dashboard itself writes (named, as every key is, by batchd.producers.keys).

==================================  ======  =================================================
key                                 type    holds
==================================  ======  =================================================
<prefix>:dashboard:audit            stream  one entry per operator action: who, what, outcome
<prefix>:dashboard:redrives         hash    ``entry:<dead entry id>`` and ``job:<new id>``
                                            -> the re-drive's JSON record (new job, old job,
                                            who, note, when)
<prefix>:control:<consumer>         hash    a daemon's requested state: ``intake`` (paused or
                                            open), ``drain`` (1), ``at``, ``by``
==================================  ======  =================================================

Under ``control:``, not ``daemon:``: ``batchd top`` and the claim scripts read every
``daemon:*`` key as a heartbeat.
"""

from __future__ import annotations

from batchd.producers.keys import Keys

AUDIT_MAXLEN = 10_000


def audit_stream(keys: Keys) -> str:
    return keys.dashboard_audit


def redrives(keys: Keys) -> str:
    return keys.dashboard_redrives


def control(keys: Keys, consumer: str) -> str:
    """Consumer names are free text (``host:pid`` by default): callers name only a live
    daemon's, read from its heartbeat key."""
    return keys.control(consumer)
