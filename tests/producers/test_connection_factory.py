"""The connection factory: one URL (or the [sentinel] settings) gives every batchd process
a client on the right deployment. No server: what is checked is the client built."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from batchd.config.secrets import redact
from batchd.config.sentinel import parse_sentinel_url
from batchd.config.settings import SettingsError, load_settings
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.connection import async_redis_client, async_redis_pool, redis_client

URL = "redis+sentinel://app:m%40ster@s1:26380,s2,[::1]:26381/cache/3?sentinel_password=sp"


def test_url_names_sentinels_service_db_and_both_credentials() -> None:
    target = parse_sentinel_url(URL)
    assert target.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert target.service_name == "cache"
    assert target.master == {"username": "app", "password": "m@ster", "db": 3}
    assert target.sentinel == {"password": "sp"}
    assert not target.tls


def test_tls_scheme_covers_master_and_sentinels() -> None:
    target = parse_sentinel_url("rediss+sentinel://s1/svc?ssl_cert_reqs=none")
    assert target.tls
    assert target.master["ssl"] is True and target.master["db"] == 0
    assert target.sentinel == {"ssl": True, "ssl_cert_reqs": "none"}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://s1:26379", "no service name"),
        ("redis+sentinel:///svc", "no Sentinel address"),
        ("redis+sentinel://s1:port/svc", "bad port"),
        ("redis+sentinel://:secret@s1:0/svc", "bad port"),
    ],
)
def test_bad_urls_are_refused_without_their_password(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        parse_sentinel_url(url)
    assert "secret" not in str(caught.value)


def test_sync_client_is_on_a_sentinel_managed_pool() -> None:
    client = redis_client(URL, socket_timeout=7.0, socket_connect_timeout=9.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "cache" and pool.is_master
    kwargs = pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "m@ster", 3)
    assert kwargs["socket_timeout"] == 7.0  # the caller's options reach the master
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"]) for s in sentinels] == [
        ("s1", 26380),
        ("s2", 26379),
        ("::1", 26381),
    ]
    # The Sentinels' own password, and short timeouts whatever the master's are.
    assert {s["password"] for s in sentinels} == {"sp"}
    assert {s["socket_timeout"] for s in sentinels} == {2.0}
    client.close()


def test_async_pools_follow_sentinel_too_blocking_or_not() -> None:
    async def build() -> None:
        client = async_redis_client(URL, socket_timeout=3.0)
        assert isinstance(client.connection_pool, AsyncSentinelPool)
        await client.aclose()
        pool = async_redis_pool(URL, blocking=True, max_connections=4, timeout=1.5)
        assert isinstance(pool, AsyncSentinelPool)
        assert isinstance(pool, aioredis.BlockingConnectionPool)
        assert (pool.max_connections, pool.timeout) == (4, 1.5)
        await pool.disconnect()

    asyncio.run(build())


def test_tls_gives_tls_connections() -> None:
    client = redis_client("rediss+sentinel://s1/svc")
    assert issubclass(client.connection_pool.connection_class, SentinelManagedSSLConnection)
    client.close()


def test_plain_urls_stay_plain() -> None:
    client = redis_client("redis://127.0.0.1:6399/2", socket_timeout=4.0)
    assert type(client.connection_pool) is redis.ConnectionPool
    assert client.connection_pool.connection_kwargs["db"] == 2
    client.close()


def test_settings_section_and_url_give_the_same_clients() -> None:
    settings = load_settings(
        sentinel={
            "addresses": ["s1:26380", "s2"],
            "service_name": "cache",
            "db": 3,
            "username": "app",
            "password": "m@ster",
            "sentinel_password": "s:p",
        }
    )
    url = settings.connection_url()
    target = parse_sentinel_url(url)
    assert target.sentinels == (("s1", 26380), ("s2", 26379))
    assert target.master == {"username": "app", "password": "m@ster", "db": 3}
    assert target.sentinel == {"password": "s:p"}
    assert "m@ster" not in redact(url) and "s:p" not in redact(url)
    with Client(url) as client:
        assert isinstance(client.redis.connection_pool, SentinelConnectionPool)


def test_clients_and_settings_take_a_sentinel_url() -> None:
    settings = load_settings(redis_url=URL)
    assert settings.connection_url() == URL
    client = AsyncClient(URL)
    assert isinstance(client.redis.connection_pool, AsyncSentinelPool)
    asyncio.run(client.aclose())
    with pytest.raises(SettingsError, match="redis_url"):
        load_settings(redis_url="sentinel://s1/svc")
    with pytest.raises(SettingsError, match="no service name"):
        load_settings(redis_url="redis+sentinel://s1,s2")
    with pytest.raises(SettingsError, match="sentinel.addresses"):
        load_settings(sentinel={"addresses": ["s1:notaport"]})
