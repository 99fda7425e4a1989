"""``batchd submit | status | cancel | stream | top`` on a partitioned layout (a plain
redis-server in 3 partitions, and a real Redis Cluster by its ``redis+cluster://`` URL)."""

from __future__ import annotations

import json

import pytest

from batchd.daemon.cli import main
from batchd.producers.keys import CONSUMER_GROUP, EVENT_FIELD, event_id
from batchd.producers.schema import Event, FinishReason, JobState
from support.partitions import PARTITIONS, Partitioned


def run(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str]:
    code = main(["--redis-url", url, *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


def test_job_commands_reach_the_jobs_partition(
    partitioned: Partitioned, capsys: pytest.CaptureFixture[str]
) -> None:
    keys, admin, url = partitioned.keys, partitioned.admin, partitioned.url
    for job_id in ("c1", "c2", "c3", "c4"):
        assert run(capsys, url, "submit", "hello", "--id", job_id)[1] == f"{job_id}\n"
    assert {keys.partition(j) for j in ("c1", "c2", "c3", "c4")} != {0}
    status = json.loads(run(capsys, url, "status", "c2", "--json")[1])
    assert (status["state"], status["queue"]) == ("queued", "default")
    assert admin.xlen(keys.queue_for("default", "c2")) >= 1
    assert run(capsys, url, "cancel", "c3")[1] == "cancel requested for c3\n"
    assert admin.xlen(keys.cancel_for("c3")) == 1
    for event in (
        Event(seq=0, token_id=1, text="do"),
        Event(seq=1, token_id=2, text="ne"),
        Event(seq=2, finish_reason=FinishReason.stop, text="done"),
    ):
        admin.xadd(keys.events("c4"), {EVENT_FIELD: event.encode()}, id=event_id(event.seq))
    admin.hset(keys.job("c4"), "state", JobState.finished.value)
    assert "done" in run(capsys, url, "stream", "c4")[1]


def test_top_sums_a_queue_over_its_partitions(
    partitioned: Partitioned, capsys: pytest.CaptureFixture[str]
) -> None:
    keys, admin, url = partitioned.keys, partitioned.admin, partitioned.url
    ids = [f"t{i}" for i in range(12)]
    for job_id in ids:
        run(capsys, url, "submit", "hi", "--id", job_id, "--queue", "fast")
    run(capsys, url, "submit", "hi", "--id", "other")
    for stream in keys.queue_partitions("fast"):
        admin.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        admin.xreadgroup(CONSUMER_GROUP, "d1", {stream: ">"}, count=1)
    snapshot = json.loads(run(capsys, url, "top", "--once", "--json")[1])
    queues = {q["name"]: q for q in snapshot["queues"]}
    assert set(queues) == {"default", "fast"}
    fast = queues["fast"]
    assert (fast["length"], fast["pending"], fast["unread"]) == (12, PARTITIONS, 12 - PARTITIONS)
    assert [(c["name"], c["pending"]) for c in fast["consumers"]] == [("d1", PARTITIONS)]
    assert queues["default"]["length"] == 1


@pytest.mark.parametrize("argv", [["bulk", "in.jsonl", "--out", "out.jsonl"], ["bulk-worker"]])
def test_the_bulk_queue_refuses_a_cluster(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """rq's workers need one server's pool: said at once, before anything is enqueued."""
    assert main(["--redis-url", "redis+cluster://127.0.0.1:1", *argv]) == 2
    assert "rq, whose workers do not support Redis Cluster" in capsys.readouterr().err
