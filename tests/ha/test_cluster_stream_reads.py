"""Script calls and stream reads on a Redis Cluster route by their own keys, without
asking a server.

redis-py's cluster client finds the keys of a command whose keys move (XREAD,
XREADGROUP) with COMMAND GETKEYS, and its pipeline does so for every command it has no
policy for (EVALSHA too): one round trip to one node each, so on a busy deployment that
node serves as many lookups as the whole cluster serves reads and scripts. batchd's
clients parse those keys themselves (batchd.producers.connection.factory.known_keys).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis

from batchd.daemon.cluster_server import ClusterDeployment
from batchd.producers.connection import async_redis_client, redis_client
from batchd.producers.keys import CONSUMER_GROUP, Keys

READS = 20


def _getkeys_calls(cluster: ClusterDeployment) -> int:
    total = 0
    for server in cluster.primaries():
        with redis.Redis.from_url(server.url) as conn:
            stats: Any = conn.info("commandstats")
            total += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


def test_scripts_and_stream_reads_need_no_key_lookups(redis_cluster: ClusterDeployment) -> None:
    keys = Keys(partitions=3, tagged=True)
    streams = keys.queue_partitions("q")
    client = redis_client(redis_cluster.url)
    length = client.register_script("return redis.call('XLEN', KEYS[1])")
    client.script_load(length.script)
    for stream in streams:
        client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        client.xadd(stream, {"n": stream})
    before = _getkeys_calls(redis_cluster)
    read: list[Any] = []
    for _ in range(READS):
        for stream in streams:
            read += client.xread({stream: "0"}, count=1)
            read += client.xreadgroup(CONSUMER_GROUP, "c", {stream: ">"}, count=1, block=1)
        pipe = client.pipeline(transaction=False)
        for stream in streams:
            pipe.xread({stream: "0"}, count=1)
            pipe.execute_command("EVALSHA", length.sha, 1, stream)
        replies = pipe.execute()
        read += [reply for replies_ in replies[0::2] for reply in replies_]
        assert replies[1::2] == [1] * len(streams)
        assert [length(keys=[stream]) for stream in streams] == [1] * len(streams)

    async def aread() -> int:
        aclient = async_redis_client(redis_cluster.url)
        try:
            got = 0
            for _ in range(READS):
                for stream in streams:
                    got += len(await aclient.xread({stream: "0"}, count=1))
            return got
        finally:
            await aclient.aclose()

    assert asyncio.run(aread()) == READS * len(streams)
    # Every read found its stream's entry, on the primary of the stream's slot ...
    assert sum(1 for name, _ in read if name.decode() in streams) == 2 * READS * len(streams) + len(
        streams
    )
    # ... and no server was asked for the keys of any of them.
    assert _getkeys_calls(redis_cluster) == before
    client.close()
