"""Every batchd tool reaches a Redis behind Sentinel from the settings alone, with the
master's credentials and the Sentinels' (different) ones: the URL form and the
``[sentinel]`` section, the client, ``batchd top``, ``batchd doctor``, ``batchd
bulk-worker``; a wrong credential of either kind is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from batchd.daemon.cli import main
from batchd.producers.client import Client
from support.sentinel import SERVICE, Credentials, SentinelDeployment, sentinel_deployment

CREDENTIALS = Credentials()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelDeployment]:
    with sentinel_deployment(tmp_path_factory.mktemp("sentinel"), credentials=CREDENTIALS) as d:
        yield d


@pytest.fixture
def config(deployment: SentinelDeployment, tmp_path: Path) -> Path:
    """A config file naming the deployment in its [sentinel] section."""
    addresses = json.dumps([s.address for s in deployment.sentinels])
    path = tmp_path / "batchd.toml"
    path.write_text(
        "[sentinel]\n"
        f"addresses = {addresses}\n"
        f'service_name = "{SERVICE}"\n'
        f'username = "{CREDENTIALS.user}"\n'
        f'password = "{CREDENTIALS.password}"\n'
        f'sentinel_password = "{CREDENTIALS.sentinel_password}"\n'
    )
    return path


def test_the_client_uses_both_credentials(deployment: SentinelDeployment) -> None:
    with Client(deployment.url) as client:
        job = client.submit("Hello", max_tokens=4)
    with deployment.master.client() as direct:
        assert direct.hget(f"batchd:job:{job.id}", "state") == b"queued"
    wrong_master = deployment.url.replace(CREDENTIALS.password, "wrong", 1)
    with Client(wrong_master) as client, pytest.raises(redis.AuthenticationError):
        client.submit("Hello", max_tokens=4)
    wrong_sentinels = deployment.url.replace(CREDENTIALS.sentinel_password, "wrong")
    with Client(wrong_sentinels) as client, pytest.raises(redis.RedisError):
        client.submit("Hello", max_tokens=4)


def test_top_reads_the_fleet_through_the_section(
    deployment: SentinelDeployment, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(deployment.url, queue="tools") as client:
        client.submit("Hello", max_tokens=4)
    assert main(["--config", str(config), "top", "--once", "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert "tools" in json.dumps(snapshot)


def test_doctor_checks_the_master_and_hides_the_passwords(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--config", str(config), "doctor", "--json"])
    out = capsys.readouterr().out
    redis_check = next(c for c in json.loads(out) if c["name"] == "Redis")
    assert redis_check["ok"], redis_check
    assert "redis+sentinel://batchd:***@" in redis_check["detail"]
    assert CREDENTIALS.password not in out and CREDENTIALS.sentinel_password not in out


def test_a_bulk_worker_serves_through_the_section(config: Path, tmp_path: Path) -> None:
    files = str(tmp_path / "files")
    args = ["--config", str(config), "bulk-worker", "--burst", "--no-fork", "--files-dir", files]
    assert main(args) == 0
