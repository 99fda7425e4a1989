"""The Files API: ``/v1/files``, in OpenAI's format, for batch input and output files.

Upload (purpose ``batch`` only, as ``multipart/form-data``), list, retrieve, download
and delete; a file is seen and listed only with the key that made it (another key's, or
an id that does not exist, is the same 404). Each key's files are listed from its index
(:func:`~batchd.producers.gateway.store.file_index`), which holds the newest
:data:`MAX_INDEXED_FILES` and drops entries as their records are found expired. An
upload is checked as it is stored: at most ``max_file_bytes`` (counted on the bytes
received, chunked or not: the body is cut off past the file's limit and a little form,
having buffered no more), :data:`MAX_BATCH_LINES` lines, and JSONL (some line is a JSON
object); a file that is not is refused here, not after a batch has been queued on it.
The file part is spooled to a temporary file, then copied in chunks. Each line is judged
when the batch runs. Files expire (``expires_after``: ``created_at`` plus 1 hour to 30
days; 30 days by default).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

import orjson
import redis.asyncio as aioredis
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.bulk_files import FilesDir
from batchd.producers.gateway.errors import APIError, invalid, not_found
from batchd.producers.gateway.guard import Guard, too_large
from batchd.producers.gateway.store import (
    DEFAULT_EXPIRY_S,
    MAX_EXPIRY_S,
    MIN_EXPIRY_S,
    OWNER,
    encode,
    expiring,
    file_index,
    file_key,
    file_name,
    file_record,
    is_record_id,
    new_id,
    owned,
)
from batchd.producers.keys import Keys

# OpenAI's bound on the requests of one batch file.
MAX_BATCH_LINES = 50_000
# What an upload's body may hold besides its file part (the form's fields and headers).
FORM_ALLOWANCE = 1 << 20
COPY_CHUNK = 1 << 20
# OpenAI's bound (and default) of a file listing's page; the newest files a key's index
# keeps (an older one is still retrieved by id, not listed).
MAX_LISTED = 10_000
MAX_INDEXED_FILES = 100_000
_WRITE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class BatchFileCheck:
    """Judges a batch file as its bytes pass, in any chunks: no line at all, more than
    :data:`MAX_BATCH_LINES` lines, or no line that is a JSON object is refused (400 on
    ``file``); a bad line among good ones is that line's error when the batch runs."""

    def __init__(self) -> None:
        self.lines = 0
        self.has_object = False
        self._parts: list[bytes] = []  # the line being read

    def feed(self, data: bytes) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._parts.append(data[start:end])
            self._line(b"".join(self._parts))
            self._parts = []
            start = end + 1
        if start < len(data):
            self._parts.append(data[start:])

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        self.lines += 1
        if self.lines > MAX_BATCH_LINES:
            return  # counted only: refused at the end, with the count
        if not self.has_object:
            try:
                self.has_object = isinstance(orjson.loads(line), dict)
            except orjson.JSONDecodeError:
                pass

    def end(self) -> None:
        self._line(b"".join(self._parts))
        self._parts = []
        if not self.lines:
            raise invalid(
                "file", "the file has no lines (a batch file is JSONL: one request a line)"
            )
        if self.lines > MAX_BATCH_LINES:
            raise invalid("file", f"{self.lines} lines exceed the limit of {MAX_BATCH_LINES}")
        if not self.has_object:
            raise invalid("file", "the file is not JSONL: no line is a JSON object")


def store_batch_file(source: IO[bytes], files: FilesDir, name: str, max_bytes: int) -> int:
    """Copy an uploaded file into ``files`` as ``name`` (a new file), checking it as it
    goes (:class:`BatchFileCheck`; 413 past ``max_bytes``); its size. Nothing is left
    behind when it is refused. Memory: one chunk and the longest line."""
    check, size = BatchFileCheck(), 0
    target = files.path(name)
    fd = os.open(target, _WRITE_NEW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := source.read(COPY_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise too_large(max_bytes, "file")
                check.feed(chunk)
                out.write(chunk)
        check.end()
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return size


def expiry_seconds(anchor: object, seconds: object, *, param: str) -> int:
    """OpenAI's ``expires_after`` (anchor ``created_at``, 3600 to 2592000 seconds)."""
    if anchor != "created_at":
        raise invalid(f"{param}.anchor", "must be 'created_at'")
    text = str(seconds)
    if not text.isdigit() or not MIN_EXPIRY_S <= int(text) <= MAX_EXPIRY_S:
        raise invalid(
            f"{param}.seconds", f"must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}"
        )
    return int(text)


class Files:
    """The Files API of one gateway (see the module doc)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        guard: Guard,
        files: FilesDir,
        *,
        max_file_bytes: int,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.guard = guard
        self.files = files
        self.max_file_bytes = max_file_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.listing, methods=["GET"]),
            Route("/v1/files/{file_id}", self.retrieve, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
        ]

    async def upload(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        declared = request.headers.get("content-type", "")
        if declared.split(";", 1)[0].strip().lower() != "multipart/form-data":
            raise APIError(
                400,
                f"Invalid Content-Type header ({declared or 'none'}), expected "
                "multipart/form-data (a form with the file and its purpose)",
                code="unsupported_content_type",
            )
        # The whole body is counted as it arrives: the file part and a little form.
        body_limit = self.max_file_bytes + FORM_ALLOWANCE
        limited = self.guard.limited(request, body_limit, param="file")
        file_id = new_id("file")
        async with self.guard.reading(), limited.form(max_files=1, max_fields=8) as form:
            purpose, lifetime = _purpose_and_lifetime(form)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise invalid("file", "a file part is required")
            filename = upload.filename or "upload.jsonl"
            await run_in_threadpool(self.files.make)
            size = await run_in_threadpool(
                store_batch_file, upload.file, self.files, file_name(file_id), self.max_file_bytes
            )
        now = time.time()
        created = int(now)
        record = file_record(
            file_id,
            filename=filename,
            size=size,
            purpose=purpose,
            created_at=created,
            expires_at=created + lifetime,
        )
        key = file_key(self.keys, file_id)
        await self.redis.hset(key, mapping=encode({**record, OWNER: owner}))  # type: ignore[arg-type]
        await self.redis.expireat(key, created + lifetime)
        await self.redis.zadd(expiring(self.keys), {file_name(file_id): created + lifetime})
        index = file_index(self.keys, owner)
        await self.redis.zadd(index, {file_id: now})
        await self._trim(index)
        return JSONResponse(record)

    async def _trim(self, index: str) -> None:
        """Bound a key's index: no file outlives :data:`MAX_EXPIRY_S`, and it keeps the
        newest :data:`MAX_INDEXED_FILES`."""
        await self.redis.zremrangebyscore(index, "-inf", time.time() - MAX_EXPIRY_S)
        await self.redis.zremrangebyrank(index, 0, -MAX_INDEXED_FILES - 1)

    async def listing(self, request: Request) -> Response:
        """The key's files in OpenAI's list shape: ``order`` by creation (``desc`` by
        default), ``limit`` (1 to 10,000, default 10,000) after the id ``after``, of one
        ``purpose`` when given."""
        owner = self.guard.owner(request)
        query = request.query_params
        limit = page_limit(query.get("limit"), default=MAX_LISTED, most=MAX_LISTED)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", "must be 'asc' or 'desc'")
        purpose = query.get("purpose")
        index = file_index(self.keys, owner)
        await self._trim(index)

        async def fetch(ids: list[str]) -> list[dict[str, Any] | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hgetall(file_key(self.keys, file_id))
                found = [owned(raw, owner) for raw in await pipe.execute()]
            return [r if r is None or purpose in (None, r["purpose"]) else {} for r in found]

        page = await list_page(
            self.redis,
            index,
            fetch,
            after=query.get("after"),
            limit=limit,
            desc=order == "desc",
            missing=lambda after: not_found("file", after, param="after", code="file_not_found"),
        )
        return JSONResponse(page)

    async def record(self, file_id: str, owner: str, *, param: str = "file_id") -> dict[str, Any]:
        """The file record; 404 when it does not exist, has expired or is another key's."""
        found = None
        if is_record_id(file_id):
            found = owned(await self.redis.hgetall(file_key(self.keys, file_id)), owner)
        if found is None:
            raise not_found("file", file_id, param=param, code="file_not_found")
        return found

    async def retrieve(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        return JSONResponse(await self.record(request.path_params["file_id"], owner))

    async def content(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        record = await self.record(request.path_params["file_id"], owner)
        try:
            data = await run_in_threadpool(self.files.read, file_name(record["id"]))
        except FileNotFoundError:  # its bytes were swept: it has expired
            raise not_found("file", record["id"], param="file_id", code="file_not_found") from None
        return Response(data, media_type="application/jsonl")

    async def delete(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        record = await self.record(request.path_params["file_id"], owner)
        file_id = record["id"]
        await self.redis.delete(file_key(self.keys, file_id))
        await run_in_threadpool(self.files.remove, file_name(file_id))
        await self.redis.zrem(expiring(self.keys), file_name(file_id))
        await self.redis.zrem(file_index(self.keys, owner), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _purpose_and_lifetime(form: FormData) -> tuple[str, int]:
    purpose = form.get("purpose")
    if purpose != "batch":
        raise invalid("purpose", "only 'batch' is supported")
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return purpose, DEFAULT_EXPIRY_S
    return purpose, expiry_seconds(anchor, seconds, param="expires_after")


def page_limit(text: str | None, *, default: int, most: int) -> int:
    """A listing's ``limit`` query parameter: an integer from 1 to ``most``."""
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise invalid("limit", f"must be an integer from 1 to {most}")
    return int(text)


async def list_page(
    redis: aioredis.Redis,
    index: str,
    fetch: Callable[[list[str]], Awaitable[Sequence[dict[str, Any] | None]]],
    *,
    after: str | None,
    limit: int,
    desc: bool,
    missing: Callable[[str], APIError],
) -> dict[str, Any]:
    """One page of an owner's index (a sorted set of ids by creation), in OpenAI's list
    shape. ``fetch`` gives each id's object: None when its record is gone (the id leaves
    the index), empty when it is filtered out. ``after`` not in the index: ``missing``."""
    start = 0
    if after is not None:
        rank = await (redis.zrevrank(index, after) if desc else redis.zrank(index, after))
        if not isinstance(rank, int):
            raise missing(after)
        start = rank + 1
    data: list[dict[str, Any]] = []
    stale: list[str] = []
    more = False
    while not more:
        raw = await redis.zrange(index, start, start + limit, desc=desc)
        if not raw:
            break
        start += len(raw)
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in raw]
        for item_id, item in zip(ids, await fetch(ids), strict=True):
            if item is None:
                stale.append(item_id)
            elif not item:
                continue
            elif len(data) == limit:
                more = True
                break
            else:
                data.append(item)
    if stale:
        await redis.zrem(index, *stale)
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
