"""Bulk runs and the Batch API on a real Redis Cluster: rq on a plain redis-server of its
own (``bulk.rq_redis_url``), the batchd jobs of the runs on the cluster, served by a real
daemon (``batchd serve`` on the tiny model, ``queue.partitions = 3``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
from cluster_run import cluster_daemon

from batchd.config.sections import BulkSettings, GatewaySettings
from batchd.daemon.cli import main
from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.server import uvicorn_config
from support.asgi import serve_in_thread
from support.daemon_harness import wait_until
from support.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
API_KEY = "sk-test-cluster-bulk"
LINES = 6


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterDeployment]:
    """A Redis Cluster with a daemon of 3 partitions on it, its heartbeat live."""
    if not has_cluster_cli():
        pytest.skip("redis-cli --cluster not available (needs Redis 5 or later)")
    tmp = tmp_path_factory.mktemp("cluster-bulk")
    with cluster_deployment(tmp / "cluster") as cluster, cluster_daemon(tmp, cluster, tiny_model):
        admin = cluster.client()

        def beating() -> bool:
            return bool(list(admin.scan_iter(match="batchd:daemon:*")))

        wait_until(beating, timeout=20, what="a heartbeat")
        admin.close()
        yield cluster


def batchd(cluster: str, rq: str, *argv: str) -> subprocess.Popen[bytes]:
    """A batchd command in a subprocess, configured by the environment only."""
    env = {**os.environ, "BATCHD_REDIS_URL": cluster, "BATCHD_BULK__RQ_REDIS_URL": rq}
    env.pop("BATCHD_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "batchd.daemon.cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finished(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()
    return out


def test_a_bulk_run_on_the_cluster_with_rq_on_its_own_redis(
    served: ClusterDeployment, redis_server: RedisServer, tmp_path: Path
) -> None:
    source = tmp_path / "prompts.jsonl"
    prompts = [{"prompt": f"line {n}", "max_tokens": 4, "temperature": 0} for n in range(LINES)]
    source.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "results.jsonl"
    files = ["--files-dir", str(tmp_path / "files")]
    argv = ["bulk", str(source), "--out", str(out), "--follow", *files]
    run = batchd(served.url, redis_server.url, *argv)
    rq = redis_server.client()
    deadline = time.monotonic() + 20
    while not rq.llen("rq:queue:batchd-bulk"):  # enqueued on rq's own Redis
        assert run.poll() is None, run.communicate()[1].decode()
        assert time.monotonic() < deadline, "the run was never enqueued"
        time.sleep(0.05)
    worker = batchd(served.url, redis_server.url, "bulk-worker", "--burst", *files)
    finished(worker, timeout=60)
    finished(run, timeout=10)
    results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert sorted(r["line"] for r in results) == list(range(1, LINES + 1))
    assert all(r.get("text") and r["finish_reason"] == "length" for r in results), results
    admin = served.client()
    # rq's queue, registries and the workers' heartbeats stayed on rq's own Redis.
    assert not list(admin.scan_iter(match="rq:*"))
    assert not list(admin.scan_iter(match="batchd:bulk:*"))
    admin.close()


def test_a_batch_through_a_gateway_on_the_cluster(
    served: ClusterDeployment, redis_server: RedisServer, tmp_path: Path
) -> None:
    files_dir = tmp_path / "files"
    options = GatewayOptions(api_keys=[API_KEY], files_dir=files_dir, rq_redis_url=redis_server.url)
    settings = GatewaySettings(host="127.0.0.1", port=free_port())
    config = uvicorn_config(create_app(served.url, options), settings, log_level="warning")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(3)
    ]
    source = tmp_path / "batch.jsonl"
    source.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    with serve_in_thread(config) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        with source.open("rb") as upload:
            file = oai.files.create(file=upload, purpose="batch")
        batch = oai.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.model_extra and batch.model_extra["notice"]["code"] == "no_bulk_worker"
        worker = batchd(
            served.url, redis_server.url, "bulk-worker", "--burst", "--files-dir", str(files_dir)
        )
        finished(worker, timeout=60)
        done = oai.batches.retrieve(batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None and done.request_counts.completed == 3
        assert done.output_file_id is not None
        output = oai.files.content(done.output_file_id).read().splitlines()
        oai.close()
    assert sorted(orjson.loads(line)["custom_id"] for line in output) == ["r0", "r1", "r2"]


def test_a_batch_belongs_to_its_key_on_the_cluster(
    served: ClusterDeployment, redis_server: RedisServer, tmp_path: Path
) -> None:
    """As on one Redis (test_gateway_batches.test_files_and_batches_belong_to_their_key):
    another API key can neither read, list nor cancel a key's batch, nor read or list its
    files."""
    options = GatewayOptions(
        api_keys=["sk-a", "sk-b"], files_dir=tmp_path / "files", rq_redis_url=redis_server.url
    )
    settings = GatewaySettings(host="127.0.0.1", port=free_port())
    config = uvicorn_config(create_app(served.url, options), settings, log_level="warning")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    line = {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": body}
    source = tmp_path / "batch.jsonl"
    source.write_bytes(orjson.dumps(line) + b"\n")
    with serve_in_thread(config) as url:
        a, b = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            for key in options.api_keys
        )
        with source.open("rb") as upload:
            file = a.files.create(file=upload, purpose="batch")
        batch = a.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            b.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            b.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            b.files.content(batch.input_file_id)
        assert b.batches.list().data == [] and [x.id for x in a.batches.list().data] == [batch.id]
        # Each key's file index is a key of its own slot: listed on the cluster as on one
        # Redis, and another key's index holds none of a key's files.
        with source.open("rb") as upload:
            second = b.files.create(file=upload, purpose="batch")
        assert [f.id for f in a.files.list().data] == [file.id]
        assert [f.id for f in b.files.list().data] == [second.id]
        assert b.files.delete(second.id).deleted and b.files.list().data == []
        assert a.batches.retrieve(batch.id).id == batch.id
        assert a.batches.cancel(batch.id).status == "cancelling"
        a.close()
        b.close()


@pytest.mark.parametrize("argv", [["bulk", "in.jsonl", "--out", "out.jsonl"], ["bulk-worker"]])
def test_without_rq_redis_url_a_cluster_is_refused_naming_it(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BATCHD_BULK__RQ_REDIS_URL", raising=False)
    assert main(["--redis-url", "redis+cluster://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert "bulk.rq_redis_url" in err and "BATCHD_BULK__RQ_REDIS_URL" in err


def test_rq_redis_url_may_not_name_a_cluster() -> None:
    with pytest.raises(ValueError, match="rq does not run on Redis Cluster"):
        BulkSettings(rq_redis_url="redis+cluster://127.0.0.1:1")
