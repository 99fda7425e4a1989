"""The sweep: a job whose status says ``running`` while nothing will ever run it is
found, and re-queued or ended, exactly once.

How such a job comes about: an operator's ``XDEL`` of a running job's entry, or an
entry acked while its status was not ended, leave a ``running`` status with nothing a
daemon would read or claim; if its daemon then dies, the job's followers would wait
forever. (Redis with AOF ``everysec`` can
also lose a job's submit while a daemon holds the job; that daemon's first append
then finds the entry gone and adds it again from memory instead of writing the keys
again with nothing behind them: batchd.daemon.worker.fence.)

Every claim interval each daemon scans a slice of the status hashes (``SCAN`` with
a cursor kept across calls, so one pass over a large keyspace is spread over many
intervals). A ``running`` job is a *suspect* when the script below finds that no
daemon holds it (its daemon's heartbeat is gone or stalled, by the claim rule of
batchd.daemon.fleet.recovery; or it is this daemon, which does not hold it) and its
queue entry is neither pending nor waiting to be read. A suspect still stuck after
a heartbeat TTL (a live daemon's heartbeat is back by then after a Redis restart)
is resolved by the same script, which checks all of it again atomically:

- its entry is still in the stream (delivered and acked): the entry is added again
  and the status names the new one, so a daemon picks the job up and resumes it from
  its events stream (every job samples as if seeded: the same tokens);
- its entry is gone: nothing holds the request any more. The job ends with a final
  ``error`` event after its stored tokens (or the status is repaired from a final
  event already stored), its epoch is raised so that a daemon cut off from Redis can
  no longer write to it, and both keys get the result TTL.

The scan also gives the result TTL to an ended job's keys that have none (Redis kept
the end and lost the EXPIREs the daemon sent in the next round trip), and to a status
hash with no state (a late append's fields on keys a crash took).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import ClusterPipeline

from batchd.daemon.fleet.liveness import DEAD_RULE, Liveness
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.redis_io import load_scripts, pipeline_replies, queue_script
from batchd.producers.keys import EVENT_FIELD, Keys, event_id, is_name
from batchd.producers.schema import (
    FINAL_STATE,
    Choice,
    Event,
    FinishReason,
    JobState,
    Timings,
)

log = logging.getLogger(__name__)

_ENDED = {state.value.encode() for state in JobState if state.terminal}

# Status hashes one call looks at (one SCAN step, one pipelined read of their fields).
SCAN_COUNT = 1000

LOST_ENTRY_ERROR = (
    "Redis lost this job's queue entry (a crash after acknowledging writes, or the entry "
    "was deleted) and no daemon holds it: its request is gone, so it cannot run again; "
    "submit it again under a new id"
)

# KEYS[1] status hash, KEYS[2] events stream, KEYS[3] queue stream. ARGV 1-5: the claim
# rule's (heartbeat key prefix, group, this consumer, unused, stall timeout s); then
# ARGV[6] the entry the caller saw, ARGV[7] its queue name, ARGV[8] '1' if the caller
# is the job's daemon and does not hold it, ARGV[9] 'check' or 'act', ARGV[10] result
# TTL s, ARGV[11] events the stream holds as the caller built its end, ARGV[12] the
# final event's id ('' when one is stored already), ARGV[13] its JSON, then the final
# status field/value pairs. Returns {'moved'} (not running, or another entry or queue
# now), {'held'}, {'queued'}, {'requeue'} or {'end', events} when checking, and
# {'requeued', new entry id} or {'ended'} when acting ({'end', events} again when the
# events stream changed since the caller read it).
_SWEEP = (
    DEAD_RULE
    + """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function waiting(id)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[3])
  if not ok then return true end
  for _, group in ipairs(groups) do
    local g = {}
    for i = 1, #group, 2 do g[group[i]] = group[i + 1] end
    if g['name'] == ARGV[2] then
      local ms, seq = parse(id)
      local lms, lseq = parse(g['last-delivered-id'])
      return ms > lms or (ms == lms and seq > lseq)
    end
  end
  return true
end
local h = redis.call('HMGET', KEYS[1], 'state', 'entry', 'queue', 'daemon')
if h[1] ~= 'running' or h[2] ~= ARGV[6] or h[3] ~= ARGV[7] then return {'moved'} end
if ARGV[8] ~= '1' and h[4] and not dead(h[4]) then return {'held'} end
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[3], ARGV[2], ARGV[6], ARGV[6], 1)
if not ok or #pending > 0 then return {'queued'} end
local found = redis.call('XRANGE', KEYS[3], ARGV[6], ARGV[6])
if #found > 0 then
  if waiting(ARGV[6]) then return {'queued'} end
  if ARGV[9] ~= 'act' then return {'requeue'} end
  local id = redis.call('XADD', KEYS[3], '*', unpack(found[1][2]))
  redis.call('HSET', KEYS[1], 'entry', id)
  return {'requeued', id}
end
local n = redis.call('XLEN', KEYS[2])
if ARGV[9] ~= 'act' or tonumber(ARGV[11]) ~= n then return {'end', n} end
if ARGV[12] ~= '' then redis.call('XADD', KEYS[2], ARGV[12], '"""
    + EVENT_FIELD
    + """', ARGV[13]) end
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') + 1
redis.call('HSET', KEYS[1], 'epoch', epoch, 'owner', ARGV[3], unpack(ARGV, 14))
redis.call('EXPIRE', KEYS[1], ARGV[10])
redis.call('EXPIRE', KEYS[2], ARGV[10])
return {'ended'}
"""
)


@dataclass(frozen=True)
class _Suspect:
    job_id: str
    entry: str
    queue: str
    mine: bool  # this daemon is the job's daemon (and did not hold it when seen)
    since: float  # monotonic time it was first found stuck


class Sweep:
    """Finds ``running`` jobs nothing will run, and re-queues or ends each once."""

    def __init__(
        self,
        member: Member,
        *,
        heartbeat_ttl_s: float,
        stall_timeout_s: float,
        result_ttl_s: int,
        scan_count: int = SCAN_COUNT,
    ) -> None:
        self.member = member
        self.grace_s = heartbeat_ttl_s
        self.liveness = Liveness(member, stall_timeout_s=stall_timeout_s)
        self.result_ttl_s = result_ttl_s
        self.scan_count = scan_count
        # Where the SCAN goes on: one cursor, or on a Cluster one per primary (by name).
        self._cursor = 0
        self._cursors: dict[str, int] = {}
        self._suspects: dict[str, _Suspect] = {}
        # Ended jobs' keys seen without a TTL, and when: the EXPIREs follow the end in the
        # daemon's next round trip, so only those still without one a grace later lost them.
        self._untimed: dict[str, float] = {}
        self._script = member.redis.register_script(_SWEEP)

    def run(self, *, held: set[str], now: float | None = None) -> dict[str, int]:
        """One step: scan the next slice of status hashes, then resolve the suspects stuck
        for a heartbeat TTL. ``held``: entry ids this daemon accounts for. Returns how many
        jobs were re-queued and ended. Raises Redis errors (suspects are kept)."""
        now = time.monotonic() if now is None else now
        self.liveness.refresh()
        self._scan(held, now)
        done = {"requeued": 0, "ended": 0}
        for suspect in list(self._suspects.values()):
            if now - suspect.since < self.grace_s:
                continue
            if suspect.mine and suspect.entry in held:
                del self._suspects[suspect.job_id]
                continue
            try:
                outcome = self._resolve(suspect)
            except redis.ResponseError as exc:  # this job's keys alone (e.g. WRONGTYPE)
                log.error("job %s: sweep failed: %s", suspect.job_id, exc)
                outcome = "failed"
            if outcome in done:
                done[outcome] += 1
            if outcome != "end":  # resolved, or not stuck after all
                del self._suspects[suspect.job_id]
        return done

    def _next_keys(self) -> list[bytes]:
        """The next slice of the status hashes of every partition (every primary's on a
        Redis Cluster, whose SCAN reaches one node)."""
        client: Any = self.member.redis
        match = self.member.keys.job_pattern()
        if not self.member.cluster:
            cursor, keys = client.scan(
                self._cursor, match=match, count=self.scan_count, _type="hash"
            )
            self._cursor = int(cursor)
            return list(keys)
        out: list[bytes] = []
        cursors = {}
        for node in client.get_primaries():
            at = self._cursors.get(node.name, 0)
            found = client.scan(
                at, match=match, count=self.scan_count, _type="hash", target_nodes=node
            )
            cursors[node.name] = found[0][node.name]
            out += found[1]
        self._cursors = cursors  # a primary gone in a failover is forgotten with its cursor
        return out

    def _scan(self, held: set[str], now: float) -> None:
        client = self.member.redis
        keys = self._next_keys()
        if not keys:
            return
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "state", "entry", "queue", "daemon")
            pipe.ttl(key)
        replies = pipe.execute()
        seen = []
        untimed = []
        for key, (state, entry, queue, daemon), ttl in zip(
            keys, replies[::2], replies[1::2], strict=True
        ):
            job_id = _job_id(self.member.keys, key)
            if job_id is None:
                continue
            if (state is None or state in _ENDED) and ttl == -1:
                if now - self._untimed.setdefault(job_id, now) >= self.grace_s:
                    untimed.append(job_id)
            else:
                self._untimed.pop(job_id, None)
            if state != JobState.running.value.encode() or entry is None or queue is None:
                continue
            mine = daemon is not None and daemon.decode() == self.member.consumer
            if job_id in self._suspects or (mine and entry.decode() in held):
                continue
            seen.append(_Suspect(job_id, entry.decode(), queue.decode(), mine, now))
        self._give_ttl(untimed)
        self._check(seen)

    def _check(self, seen: list[_Suspect]) -> None:
        """Keep those of ``seen`` the script finds stuck (checking only, no write)."""
        if not seen:
            return
        if self.member.cluster:
            load_scripts(self.member.redis, self._script)  # queue_script's NOSCRIPT
        pipe = self.member.redis.pipeline(transaction=False)
        for suspect in seen:
            self._call(suspect, "check", client=pipe)
        for suspect, reply in zip(seen, pipeline_replies(pipe), strict=True):
            if isinstance(reply, redis.ResponseError):
                log.error("job %s: sweep check failed: %s", suspect.job_id, reply)
            elif reply[0] in (b"requeue", b"end"):
                self._suspects[suspect.job_id] = suspect

    def _give_ttl(self, job_ids: list[str]) -> None:
        """An ended job's keys still without a TTL a grace after first seen: Redis kept the
        end and lost the EXPIREs sent after it (a crash between the two round trips); or a
        hash with no state at all (a late append's fields on keys a crash took). They get
        the result TTL."""
        if not job_ids:
            return
        pipe = self.member.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.expire(self.member.keys.job(job_id), self.result_ttl_s)
            pipe.expire(self.member.keys.events(job_id), self.result_ttl_s)
        pipe.execute()
        for job_id in job_ids:
            del self._untimed[job_id]
        log.warning("%d ended job(s) had no TTL (lost EXPIREs): given the result TTL", len(job_ids))

    def _resolve(self, suspect: _Suspect) -> str:
        """Act on a suspect (the script checks it again); the script's outcome."""
        reply = self._call(suspect, "act")
        detail = ""
        if reply[0] == b"requeued":
            detail = f"its entry still in the stream, enqueued again as {reply[1].decode()}"
        elif reply[0] == b"end":
            end = self._end(suspect)
            reply = self._call(suspect, "act", end=end)
            detail = f"its entry gone, ended: {end.error}"
        outcome: str = reply[0].decode()
        if outcome in ("requeued", "ended"):
            log.warning(
                "job %s: running, entry %s neither pending nor to be read, no daemon holds it; %s",
                suspect.job_id,
                suspect.entry,
                detail,
            )
        return outcome

    def _end(self, suspect: _Suspect) -> _End:
        """The end of a job from what its keys hold: the status of a final event already
        stored, else a final error event after the stored tokens."""
        client = self.member.redis
        keys = self.member.keys
        entries: Any = client.xrange(keys.events(suspect.job_id))
        status: Any = client.hgetall(keys.job(suspect.job_id))
        now = time.time()
        try:
            events = [Event.decode(fields[EVENT_FIELD.encode()]) for _, fields in entries]
        except (ValueError, KeyError) as exc:
            # Nothing can follow an unreadable stream: the status alone says how it ended.
            error = f"{LOST_ENTRY_ERROR}; its events stream is unreadable ({exc})"
            return _End(len(entries), None, FinishReason.error, error, now, 0)
        if events and events[-1].final:
            final = events[-1]
            reason = final.finish_reason
            assert reason is not None
            return _End(len(events), None, reason, final.error, now, _count(events))
        final = _final_error(events, status, at=now)
        return _End(len(events), final, FinishReason.error, final.error, now, _count(events))

    def _call(
        self, suspect: _Suspect, mode: str, *, end: _End | None = None, client: Any = None
    ) -> Any:
        keys = self.member.keys
        args: list[str | int] = [
            *self.liveness.args(0),
            suspect.entry,
            suspect.queue,
            "1" if suspect.mine else "0",
            mode,
            self.result_ttl_s,
        ]
        if end is not None:
            args += end.args()
        job_id = suspect.job_id
        # A job that ran was filed in its id's partition (Job.misfiled): one slot.
        queue = keys.queue_for(suspect.queue, job_id)
        names = [keys.job(job_id), keys.events(job_id), queue]
        if isinstance(client, ClusterPipeline):
            queue_script(client, self._script, names, args)
            return client
        return self._script(keys=names, args=args, client=client)


@dataclass(frozen=True)
class _End:
    stored: int  # events the stream held when this end was built
    event: Event | None  # the final event to append (None: one is stored)
    reason: FinishReason
    error: str | None
    finished_at: float
    completion_tokens: int

    def args(self) -> list[str | int]:
        head: list[str | int] = [self.stored]
        if self.event is None:
            head += ["", ""]
        else:
            head += [event_id(self.event.seq), self.event.encode().decode()]
        fields = {
            "state": FINAL_STATE[self.reason].value,
            "finish_reason": self.reason.value,
            "finished_at": repr(self.finished_at),
            "completion_tokens": str(self.completion_tokens),
        }
        if self.error is not None:
            fields["error"] = self.error
        return head + [part for pair in fields.items() for part in pair]


def _job_id(keys: Keys, key: bytes) -> str | None:
    """The id of the job whose status hash ``key`` is, None for any other key (a name
    that only looks like one, or a job's keys filed under another partition)."""
    text = key.decode(errors="replace")
    job_id = text.rsplit(":", 1)[-1]
    return job_id if is_name(job_id) and keys.job(job_id) == text else None


def _count(events: list[Event]) -> int:
    return sum(event.token_id is not None for event in events)


def _final_error(events: list[Event], status: dict[bytes, bytes], *, at: float) -> Event:
    """A final error event after ``events`` (the stored tokens): full text per sequence,
    the timings the status recorded. Usage is left out: the prompt is not known here."""
    texts: dict[int, list[str]] = {}
    counts: dict[int, int] = {}
    for event in events:
        index = event.index or 0
        texts.setdefault(index, []).append(event.text)
        counts[index] = counts.get(index, 0) + 1
    choices = None
    if any(index > 0 for index in texts):
        choices = [
            Choice(
                index=index,
                text="".join(texts.get(index, [])),
                finish_reason=FinishReason.error,
                completion_tokens=counts.get(index, 0),
            )
            for index in range(max(texts) + 1)
        ]
    return Event(
        seq=len(events),
        text="".join(texts.get(0, [])),
        choices=choices,
        finish_reason=FinishReason.error,
        timings=Timings(
            queued=_float(status.get(b"queued_at")),
            started=_float(status.get(b"started_at")),
            first_token=_float(status.get(b"first_token_at")),
            finished=at,
        ),
        error=LOST_ENTRY_ERROR,
    )


def _float(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
