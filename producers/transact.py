"""Submit and cancel as one script each, with the decision logic free of I/O.

The sync and async clients send the same script with the same arguments and
read the reply the same way (:class:`SubmitPlan`, :class:`CancelPlan`); only
the call differs. One script instead of WATCH/MULTI means a connection error is
a connection error (redis-py reports a connection lost inside WATCH as a
WatchError, which looked like "already submitted"), and a retried submit is
recognised as the same one by its ``submit_token``: safe to retry.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from batchd.producers.keys import CANCEL_FIELD, CANCEL_MAXLEN, ENTRY_FIELD, JOB_FIELD, Keys
from batchd.producers.schema import JobState

_TERMINAL = ", ".join(f"['{state.value}'] = true" for state in JobState if state.terminal)

# Lua shared by the submit scripts: ``enqueue`` appends a job's entry after its status
# hash is written. Redis keeps a script's writes made before a command that fails (no
# rollback), so an entry refused there (the queue key holds another type, an ACL user
# may write hashes but not XADD, the stream is out of ids) would leave a job that is
# never queued, and a retry with the same submit token would take it as queued: the
# refusal deletes that hash and the entries and hashes the script wrote before, and
# ``enqueue`` returns Redis's error for the script to return (nil once queued). A queued
# job's status hash names its entry (``entry``), written with it: whoever holds the
# job id finds its queue entry without searching the stream.
_ENQUEUE = f"""
local written = {{}}
local function enqueue(hash, stream, payload)
  local added = redis.pcall('XADD', stream, '*', '{JOB_FIELD}', payload)
  if type(added) == 'table' and added.err then
    redis.pcall('DEL', hash)
    for _, done in ipairs(written) do
      redis.pcall('XDEL', stream, done[2])
      redis.pcall('DEL', done[1])
    end
    return added
  end
  redis.call('HSET', hash, '{ENTRY_FIELD}', added)
  written[#written + 1] = {{hash, added}}
end
"""

# KEYS[1] status hash, KEYS[2] queue stream. ARGV[1] submit token, ARGV[2] job JSON,
# then the initial status field/value pairs. Returns {'ok'}, {'exists', token, state,
# key id}, or Redis's error when the entry is refused (nothing left written: _ENQUEUE).
SUBMIT = (
    _ENQUEUE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local held = redis.call('HMGET', KEYS[1], 'submit_token', 'state', 'key_id')
  return {'exists', held[1] or '', held[2] or '', held[3] or ''}
end
redis.call('HSET', KEYS[1], 'submit_token', ARGV[1], unpack(ARGV, 3))
local refused = enqueue(KEYS[1], KEYS[2], ARGV[2])
if refused then return refused end
return {'ok'}
"""
)

# Several jobs onto one queue, all or none. KEYS: each job's status hash, then the queue
# stream. ARGV[1] '1' to attach to jobs that exist, ARGV[2] the count k of initial status
# field/value pairs, the k pairs, then each job's submit token and job JSON. Checks every
# job first: returns {'exists', i, token, state} for the first job i (1-based) that exists
# under another submit token unless attaching, having written nothing; else writes the
# jobs that do not exist yet (a job holding its own token is a retried call's) in order
# and returns {'ok'}. One XADD after another in one script: a daemon blocked on the
# queue is answered once, with every job. A refused entry undoes the call's writes and
# returns Redis's error (_ENQUEUE): all or none still.
SUBMIT_MANY = (
    _ENQUEUE
    + """
local n = #KEYS - 1
local first = 3 + 2 * tonumber(ARGV[2])
local fresh = {}
for i = 1, n do
  local token = ARGV[first + 2 * (i - 1)]
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local held = redis.call('HMGET', KEYS[i], 'submit_token', 'state')
    if held[1] ~= token and ARGV[1] ~= '1' then
      return {'exists', i, held[1] or '', held[2] or ''}
    end
  else
    fresh[#fresh + 1] = i
  end
end
for _, i in ipairs(fresh) do
  local at = first + 2 * (i - 1)
  redis.call('HSET', KEYS[i], 'submit_token', ARGV[at], unpack(ARGV, 3, first - 1))
  local refused = enqueue(KEYS[i], KEYS[n + 1], ARGV[at + 1])
  if refused then return refused end
end
return {'ok'}
"""
)

# KEYS[1] status hash, KEYS[2] cancel stream; ARGV[1] job id, ARGV[2] cancel stream MAXLEN.
# Returns the job's state ('' when there is no status hash) and 1 if the request was made.
CANCEL = f"""
local terminal = {{{_TERMINAL}}}
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {{'', 0}} end
if terminal[state] then return {{state, 0}} end
redis.call('HSET', KEYS[1], 'cancel_requested', '1')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', '{CANCEL_FIELD}', ARGV[1])
return {{state, 1}}
"""


@dataclass(frozen=True)
class SubmitPlan:
    """One submit: its script call, and what the reply means."""

    job_id: str
    queue: str
    keys: list[str]
    args: list[Any]
    token: str

    @classmethod
    def make(
        cls, keys: Keys, job_id: str, queue: str, payload: bytes, status: dict[Any, Any]
    ) -> SubmitPlan:
        token = secrets.token_hex(8)
        args: list[Any] = [token, payload]
        for name, value in status.items():
            args += [name, value]
        return cls(job_id, queue, [keys.job(job_id), keys.queue_for(queue, job_id)], args, token)

    def enqueued(self, reply: Any) -> bool:
        """True when this submit enqueued the job (now or in an attempt whose reply was
        lost); False when it existed before; raises nothing."""
        if _text(reply[0]) == "ok":
            return True
        return _text(reply[1]) == self.token

    def existing_state(self, reply: Any) -> str | None:
        return _text(reply[2]) or None

    def existing_key_id(self, reply: Any) -> str | None:
        """The gateway key id that owns the job that existed before (None: a raw producer's)."""
        return _text(reply[3]) or None if len(reply) > 3 else None


@dataclass(frozen=True)
class SubmitManyPlan:
    """One script call submitting several jobs of one partition onto one queue (all or
    none), and what the reply means; a submit_many call sends one per partition."""

    job_ids: list[str]
    queue: str
    keys: list[str]
    args: list[Any]

    @classmethod
    def make(
        cls,
        keys: Keys,
        jobs: list[tuple[str, bytes]],
        queue: str,
        status: dict[Any, Any],
        *,
        attach: bool,
    ) -> SubmitManyPlan:
        """``jobs``: each job's id and payload, in the order they are enqueued; all of one
        partition (:func:`by_partition`)."""
        args: list[Any] = ["1" if attach else "0", len(status)]
        for name, value in status.items():
            args += [name, value]
        for _, payload in jobs:
            args += [secrets.token_hex(8), payload]
        job_keys = [keys.job(job_id) for job_id, _ in jobs]
        stream = keys.queue_for(queue, jobs[0][0])
        return cls([job_id for job_id, _ in jobs], queue, [*job_keys, stream], args)

    def clash(self, reply: Any) -> tuple[str, str | None] | None:
        """The job that existed before under another submit (its id and state), when the
        call wrote nothing; None when the jobs are queued (or attached to)."""
        if _text(reply[0]) == "ok":
            return None
        index = int(reply[1]) - 1
        return self.job_ids[index], _text(reply[3]) or None


@dataclass(frozen=True)
class SubmitManyCall:
    """A submit_many call: one :class:`SubmitManyPlan` per partition its jobs fall in
    (one, unpartitioned), in the order of each partition's first job.

    A script runs on one partition's keys, so across partitions the call is not one
    atomic write: with several parts and no ``attach``, the client first reads every
    job's status hash (:attr:`checked`) and sends nothing when one exists; each part's
    script still checks its own jobs, so a job submitted elsewhere between the read and
    its script refuses its part, after the parts before it were queued.
    """

    job_ids: list[str]
    queue: str
    parts: list[SubmitManyPlan]
    attach: bool

    # The status hash fields the pre-check reads of each job.
    checked = ("submit_token", "state")

    @property
    def checks_first(self) -> bool:
        """Whether the call reads its jobs' status hashes before writing (see above)."""
        return len(self.parts) > 1 and not self.attach

    def existing(self, held: list[Any]) -> tuple[str, str | None] | None:
        """The first job whose status hash exists (its id and state), given each job's
        HMGET of :attr:`checked` in call order; None when none does."""
        for job_id, (token, state) in zip(self.job_ids, held, strict=True):
            if token is not None or state is not None:
                return job_id, _text(state) if state is not None else None
        return None


@dataclass(frozen=True)
class CancelPlan:
    """One cancel request: its script call, and what the reply means."""

    job_id: str
    keys: list[str]
    args: list[Any]

    @classmethod
    def make(cls, keys: Keys, job_id: str) -> CancelPlan:
        return cls(job_id, [keys.job(job_id), keys.cancel_for(job_id)], [job_id, CANCEL_MAXLEN])

    @staticmethod
    def state(reply: Any) -> str | None:
        """The job's state before the request; None when the job does not exist."""
        return _text(reply[0]) or None

    @staticmethod
    def requested(reply: Any) -> bool:
        return int(reply[1]) == 1


def by_partition(keys: Keys, jobs: list[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    """``jobs`` (id, payload) grouped by partition, each group in call order, the groups
    in the order of their first job: a script may touch one partition's keys alone."""
    groups: dict[int, list[tuple[str, bytes]]] = {}
    for job in jobs:
        groups.setdefault(keys.partition(job[0]), []).append(job)
    return list(groups.values())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
