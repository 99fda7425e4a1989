"""The key layout: partitioned names, the partition rule, and the layout Redis stores.

A producer and a daemon that disagree on where a job's keys are lose the job silently,
so each rule here is checked against its definition (crc32, the slot ranges) and the
stored layout against a real redis-server.
"""

from __future__ import annotations

import zlib

import pytest
import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from batchd.producers.connection import LayoutMismatch, claim_layout, keys_for
from batchd.producers.errors import ValidationError
from batchd.producers.keys import MAX_PARTITIONS, PARTITION_CACHE, Keys, partition_tag


def test_the_default_layout_keeps_every_name() -> None:
    keys = Keys()
    assert keys.queue() == "batchd:queue:default"
    assert keys.queue_for("q", "job-1") == "batchd:queue:q"
    assert (keys.job("a"), keys.events("a"), keys.tokens("a")) == (
        "batchd:job:a",
        "batchd:job:a:events",
        "batchd:job:a:tokens",
    )
    assert (keys.cancel, keys.dead, keys.cancel_for("a"), keys.dead_for("a")) == (
        "batchd:cancel",
        "batchd:dead",
        "batchd:cancel",
        "batchd:dead",
    )
    assert keys.tokens_pattern == "batchd:job:*:tokens"
    assert keys.queue_name(b"batchd:queue:default") == ("default", 0)
    assert keys.queue_name("batchd:job:x") is None


@pytest.mark.parametrize("partitions", [1, 2, 3, 5, 16])
def test_each_partitions_keys_share_one_slot_and_partitions_spread_over_the_slots(
    partitions: int,
) -> None:
    keys = Keys("p", partitions, tagged=True)
    for k in range(partitions):
        slots = {
            key_slot(name.encode())
            for name in (keys.queue("q", k), keys.cancel_stream(k), keys.dead_stream(k))
        }
        assert len(slots) == 1
        # Partition k of N lies in the k-th of N equal ranges of the slots.
        assert slots.pop() * partitions // REDIS_CLUSTER_HASH_SLOTS == k
    for job_id in (f"job-{i}" for i in range(200)):
        k = keys.partition(job_id)
        assert k == zlib.crc32(job_id.encode()) % partitions
        names = (
            keys.job(job_id),
            keys.events(job_id),
            keys.tokens(job_id),
            keys.queue_for("q", job_id),
        )
        assert {key_slot(name.encode()) for name in names} == {
            key_slot(keys.queue("q", k).encode())
        }
        assert keys.job(job_id) == f"{keys.job_head(job_id)}job:{job_id}"


def test_jobs_spread_over_the_partitions() -> None:
    keys = Keys(partitions=3)
    counts = [0, 0, 0]
    for i in range(3000):
        counts[keys.partition(f"id-{i}")] += 1
    assert min(counts) > 900


def test_remembered_partitions_stay_right_past_the_bound_and_refusals_stay() -> None:
    keys = Keys(partitions=3)
    ids = [f"id-{i}" for i in range(PARTITION_CACHE + 10)]
    for _ in range(2):
        for job_id in ids:
            assert keys.partition(job_id) == zlib.crc32(job_id.encode()) % 3
    assert keys.events(ids[0]) == f"{keys.head(keys.partition(ids[0]))}job:{ids[0]}:events"
    for bad in ("a:events", "x}:job:y", 7, None):
        for name in (keys.partition, keys.job, keys.tokens):
            with pytest.raises(ValidationError):
                name(bad)


def test_job_patterns_cover_every_partition_and_escape_globs() -> None:
    assert Keys().job_pattern() == "batchd:job:*"
    assert Keys(partitions=3).job_pattern("ab") == "batchd:{*}:job:ab*"
    assert Keys("b*d", tagged=True).job_pattern("x?") == r"b\*d:{*}:job:x\?*"


def test_partitioned_names_parse_back_and_hostile_ids_are_refused() -> None:
    keys = Keys(partitions=3)
    assert keys.tagged
    for k in range(3):
        assert keys.queue_name(keys.queue("jobs.priority", k)) == ("jobs.priority", k)
    assert keys.queue_name(Keys().queue("q")) is None  # an untagged name is another layout's
    assert keys.tokens_pattern == "batchd:{*}:job:*:tokens"
    assert len(set(keys.queue_partitions("q"))) == 3
    assert len(set(keys.cancel_streams())) == len(set(keys.dead_streams())) == 3
    for bad in ("x}:job:y", "a:events", "", "{0.1}"):
        with pytest.raises(ValidationError):
            keys.job(bad)
    with pytest.raises(ValidationError):
        keys.queue("q}{x")


def test_partition_counts_outside_the_range_are_refused() -> None:
    for bad in (0, MAX_PARTITIONS + 1):
        with pytest.raises(ValueError, match="partitions"):
            Keys(partitions=bad)
    assert partition_tag(0, 1) == "0.0"


def test_the_first_daemon_stores_the_layout_and_a_daemon_configured_otherwise_is_refused(
    redis_client: redis.Redis,
) -> None:
    assert keys_for(redis_client, "batchd") == Keys()
    keys = claim_layout(redis_client, "batchd", 3)
    assert keys == Keys(partitions=3)
    assert claim_layout(redis_client, "batchd", 3) == keys
    with pytest.raises(LayoutMismatch, match="partitions = 3"):
        claim_layout(redis_client, "batchd", 1)
    # Every other process reads it; another prefix is another deployment.
    assert keys_for(redis_client, "batchd").queue_for("q", "j") == keys.queue_for("q", "j")
    assert keys_for(redis_client, "other") == Keys("other")


@pytest.mark.parametrize("stored", ["not json", '{"partitions": 0}', '{"partitions": "3"}', "[]"])
def test_a_layout_batchd_did_not_write_is_an_error_naming_the_key(
    redis_client: redis.Redis, stored: str
) -> None:
    redis_client.set("batchd:layout", stored)
    with pytest.raises(ValueError, match="batchd:layout"):
        keys_for(redis_client, "batchd")
