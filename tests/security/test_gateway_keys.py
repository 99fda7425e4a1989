"""Gateway keys (security finding 4), tried on a real gateway: an empty key is refused at
start (before the fix ``--api-key ""`` let a bare ``Authorization: Bearer`` in), a
comma-separated key list is trimmed (before, ``"sk-one, sk-two"`` never matched
sk-two), and a key is compared with every configured key in constant time.
"""

from __future__ import annotations

import hmac
import http.client
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from batchd.daemon.cli import main
from batchd.producers.gateway import guard as guard_module
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from support.edge import edge, serve
from support.redis_server import RedisServer


@pytest.mark.parametrize("keys", [["sk-real", ""], ["  "], ["\t"]])
def test_an_empty_key_is_refused_at_start(
    keys: list[str],
    edge_redis: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.append(app))
    argv = ["--redis-url", edge_redis.url, "gateway", "--files-dir", str(tmp_path)]
    for key in keys:
        argv += ["--api-key", key]
    assert main(argv) == 2
    assert "is empty" in capsys.readouterr().err and started == []
    with pytest.raises(ValueError, match="is empty"):
        create_app(edge_redis.url, GatewayOptions(api_keys=keys, files_dir=tmp_path))


def test_a_bare_bearer_header_never_authenticates(edge_redis: RedisServer, tmp_path: Path) -> None:
    with edge(edge_redis.url, GatewayOptions(api_keys=["sk-real"], files_dir=tmp_path)) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        for header in ("Bearer", "Bearer ", "Bearer  ", "bearer\t", "", "Basic sk-real"):
            # http.client sends the header as given (httpx refuses trailing blanks).
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/v1/models", headers={"Authorization": header})
            reply = conn.getresponse()
            assert reply.status == 401, header
            assert orjson.loads(reply.read())["error"]["code"] == "invalid_api_key"
            conn.close()
        with gw.http("sk-real") as client:
            assert client.get("/v1/models").status_code == 200


def test_the_key_list_from_the_environment_is_trimmed(
    edge_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setenv("BATCHD_GATEWAY_API_KEYS", "sk-one, sk-two ,, sk-three\n")
    argv = ["--redis-url", edge_redis.url, "gateway", "--files-dir", str(tmp_path)]
    assert main([*argv, "--api-key", " sk-cli "]) == 0
    with serve(apps[0]) as url:
        for key, status in [
            ("sk-one", 200),
            ("sk-two", 200),
            ("sk-three", 200),
            ("sk-cli", 200),
            ("sk-four", 401),
            ("sk-one,", 401),
        ]:
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers) as client:
                assert client.get("/v1/models").status_code == status, key


def test_every_key_is_compared_in_constant_time(
    edge_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hmac.compare_digest against every configured key, whichever matches: no early
    exit that would time which key (or how much of one) a guess matched."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", counting)
    keys = ["sk-first", "sk-second", "sk-third"]
    with edge(edge_redis.url, GatewayOptions(api_keys=keys, files_dir=tmp_path)) as gw:
        for key in ("sk-first", "sk-third", "sk-wrong"):
            calls.clear()
            with gw.http(key) as client:
                client.get("/v1/models")
            assert sorted(b for _, b in calls) == sorted(k.encode() for k in keys), key
