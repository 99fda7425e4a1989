"""No operation of one key changes or reveals anything of another's (the Batch API's
ownership, as a property): random interleavings of upload, create, cancel, retrieve,
download, delete and list by two keys on a real gateway and redis-server, each aimed
at an object of either key or at an id that never existed.

After every operation: an operation aimed at the other key's object (or at nothing)
is a 404 whose body names no more than the id it was given, and the other key's whole
view (its batch list, each batch, each file and its bytes) is what it was before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.producers.gateway.options import GatewayOptions
from support.edge import KEY_A, KEY_B, Edge, chat_line, edge, jsonl
from support.redis_server import RedisServer

KEYS = (KEY_A, KEY_B)
NOUN = {"files": "file", "batches": "batch"}
OPS = ("upload", "create", "cancel", "retrieve_batch", "retrieve_file", "download", "delete")


@pytest.fixture(scope="module")
def gateway(edge_redis: RedisServer, listed_model: str, tmp_path_factory: Any) -> Iterator[Edge]:
    files: Path = tmp_path_factory.mktemp("files-prop")
    with edge(edge_redis.url, GatewayOptions(api_keys=list(KEYS), files_dir=files)) as gw:
        yield gw


@dataclass
class Owned:
    """What the test knows each key holds."""

    files: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KEYS})
    batches: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KEYS})

    def pick(self, kind: str, owner: str, index: int) -> str:
        """Index ``index`` into the ids of both keys (owner's first) and one that never
        existed, so an operation may aim anywhere."""
        pool = getattr(self, kind)
        other = KEYS[1 - KEYS.index(owner)]
        ids = [*pool[owner], *pool[other], f"{NOUN[kind]}-0000000000000000"]
        return ids[index % len(ids)]

    def owner_of(self, kind: str, ident: str) -> str | None:
        return next((k for k, ids in getattr(self, kind).items() if ident in ids), None)


def view(http: httpx.Client, owned: Owned, key: str) -> dict[str, Any]:
    """Everything ``key`` can see of its own objects."""
    listed = http.get("/v1/batches", params={"limit": 100}).json()
    files = {}
    for file_id in owned.files[key]:
        record = http.get(f"/v1/files/{file_id}").json()
        files[file_id] = (record, http.get(f"/v1/files/{file_id}/content").content)
    batches = {b: http.get(f"/v1/batches/{b}").json() for b in owned.batches[key]}
    return {"list": listed, "files": files, "batches": batches}


def act(http: httpx.Client, owned: Owned, key: str, op: str, index: int) -> httpx.Response:
    """Do ``op`` as ``key``; record what it made."""
    if op == "upload":
        data = jsonl([chat_line(f"c{index}", "x", max_tokens=1)])
        reply = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("f", data)})
        owned.files[key].append(reply.json()["id"])
        return reply
    if op in ("create", "retrieve_file", "download", "delete"):
        target = owned.pick("files", key, index)
        if op == "create":
            body = {
                "input_file_id": target,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            reply = http.post("/v1/batches", json=body)
            if reply.status_code == 200:
                owned.batches[key].append(reply.json()["id"])
            return reply
        if op == "delete":
            reply = http.delete(f"/v1/files/{target}")
            if reply.status_code == 200:
                owned.files[key].remove(target)
            return reply
        suffix = "/content" if op == "download" else ""
        return http.get(f"/v1/files/{target}{suffix}")
    target = owned.pick("batches", key, index)
    if op == "cancel":
        return http.post(f"/v1/batches/{target}/cancel")
    return http.get(f"/v1/batches/{target}")


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(KEYS), st.sampled_from(OPS), st.integers(0, 7)),
        min_size=1,
        max_size=10,
    )
)
def test_no_key_changes_or_reveals_anothers(
    gateway: Edge, steps: list[tuple[str, str, int]]
) -> None:
    owned = Owned()
    clients = {k: gateway.http(k) for k in KEYS}
    try:
        for key, op, index in steps:
            other = KEYS[1 - KEYS.index(key)]
            before = view(clients[other], owned, other)
            kind = "batches" if op in ("cancel", "retrieve_batch") else "files"
            aimed = None if op == "upload" else owned.pick(kind, key, index)
            mine = aimed is None or owned.owner_of(kind, aimed) == key
            reply = act(clients[key], owned, key, op, index)
            if mine:
                assert reply.status_code in (200, 409), (op, reply.text)  # 409: cancelled
            else:  # the other key's, or nobody's: the same 404, naming only the given id
                assert reply.status_code == 404, (op, reply.text)
                error = orjson.loads(reply.content)["error"]
                assert error["message"] == f"{NOUN[kind]} {aimed!r} does not exist", error
            assert view(clients[other], owned, other) == before, (key, op)
    finally:
        for client in clients.values():
            client.close()
