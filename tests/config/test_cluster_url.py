"""``redis+cluster://`` URLs: nodes, credentials, options and the errors for bad ones."""

from __future__ import annotations

import pytest

from batchd.config.cluster import is_cluster_url, parse_cluster_url
from batchd.config.settings import Settings


def test_nodes_credentials_and_options() -> None:
    target = parse_cluster_url(
        "redis+cluster://batchd:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002/?socket_timeout=3"
    )
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert not target.tls
    assert target.options["username"] == "batchd"
    assert target.options["password"] == "pw"
    assert target.options["socket_timeout"] == 3.0
    assert "host" not in target.options and "db" not in target.options
    tls = parse_cluster_url("rediss+cluster://h:1?ssl_cert_reqs=none")
    assert tls.tls and tls.options["ssl"] is True and tls.options["ssl_cert_reqs"] == "none"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://", "no node address"),
        ("redis+cluster://h:1/3", "database 0 only"),
        ("redis+cluster://h:99999", "bad port"),
        ("redis://h:1", "not a redis\\+cluster://"),
    ],
)
def test_bad_urls_are_refused_without_their_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cluster_url(url)
    with pytest.raises(ValueError) as raised:
        parse_cluster_url(url.replace("://", "://u:secret@", 1))
    assert "secret" not in str(raised.value)


def test_settings_take_a_cluster_url_and_queue_partitions() -> None:
    assert is_cluster_url("REDIS+CLUSTER://h")
    settings = Settings(redis_url="redis+cluster://h:7000,h:7001", queue={"partitions": 3})
    assert settings.connection_url() == "redis+cluster://h:7000,h:7001"
    assert settings.queue.partitions == 3
    with pytest.raises(ValueError, match="database 0 only"):
        Settings(redis_url="redis+cluster://h:7000/2")
    with pytest.raises(ValueError):
        Settings(queue={"partitions": 65})
