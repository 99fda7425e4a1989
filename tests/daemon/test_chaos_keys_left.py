"""`batchd chaos` counts the per-job keys left after the result TTLs on a real
redis-server, and names each: a key whose TTL started late (an ack after a daemon's
death) is waited out and listed apart, a key that stays is described with its type, TTL
and contents, so a failed run says which write left it."""

from __future__ import annotations

from batchd.daemon.chaos.run import _keys_left
from batchd.producers.keys import EVENT_FIELD, Keys
from support.redis_server import RedisServer


def test_keys_left_are_named_and_late_ttls_waited_out(redis_server: RedisServer) -> None:
    keys = Keys(partitions=3, tagged=True)
    client = redis_server.client()
    client.hset(keys.job("stays"), mapping={"epoch": "2", "owner": "d1"})
    client.xadd(keys.events("late"), {EVENT_FIELD: b"{}"}, id="0-1")
    client.pexpire(keys.events("late"), 500)
    client.xadd(keys.queue(partition=1), {"job": b"{}"})
    left, late, others = _keys_left(client, keys)
    assert left == [f"{keys.job('stays')} (hash, TTL -1 s): {{'epoch': '2', 'owner': 'd1'}}"]
    assert len(late) == 1 and late[0].startswith(f"{keys.events('late')} (stream, TTL ")
    assert "1 entries, last 0-1" in late[0]
    assert others == [keys.queue(partition=1)]
    assert client.exists(keys.events("late")) == 0
