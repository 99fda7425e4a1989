"""The one folder a bulk worker reads and writes: names cross the queue, never paths.

Anyone who can write to the rq queue can name arguments for batchd's bulk functions.
So a job names its run (or its batch), and every file it touches is a plain name
inside the worker's own folder (``bulk.files_dir``), which the worker is configured
with and the job cannot name: ``<run>.input.jsonl``, ``<run>.output.jsonl``,
``file-<id>.jsonl``. Each name is checked (one path component, batchd's characters),
every open refuses a symbolic link (``O_NOFOLLOW``) and anything but a regular file,
and whole files are written to a fresh temporary name and renamed into place.

An output file that a run appends to is recognised by its owner mark, a sidecar
``<name>.owner`` holding the run and the file's inode: the torn-line repair (which
truncates) only ever touches a file batchd created for that run.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from batchd.producers.errors import BulkBusy, UnsafePath

# One path component: batchd's name characters, no leading dot (no hidden or "..").
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
OWNER_SUFFIX = ".owner"
_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_WRITE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class FilesDir:
    """The folder, resolved once; every file batchd's bulk code opens goes through it."""

    root: Path

    @classmethod
    def at(cls, folder: str | os.PathLike[str], *, create: bool = True) -> FilesDir:
        """The folder (created, private to its user, if missing, unless ``create`` is
        False: then :meth:`make` creates it before the first write)."""
        files = cls(Path(folder).expanduser().resolve())
        if create:
            files.make()
        return files

    def make(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, name: str) -> Path:
        """``root/name``; UnsafePath unless ``name`` is one plain file name."""
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or ".." in name:
            raise UnsafePath("file", f"{name!r} is not a plain file name", value=name)
        path = self.root / name
        if path.parent != self.root:  # belt and braces: the pattern has no separator
            raise UnsafePath("file", f"{name!r} leaves the files folder", value=name)
        return path

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def open(self, name: str) -> IO[bytes]:
        """``name`` open for reading; UnsafePath for a link or a non-regular file,
        OSError (FileNotFoundError) if missing."""
        try:
            fd = os.open(self.path(name), _READ)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise UnsafePath("file", f"{name!r} is a link", value=name) from None
            raise
        source = os.fdopen(fd, "rb")
        try:
            _regular(fd, name)
        except BaseException:
            source.close()
            raise
        return source

    def read(self, name: str) -> bytes:
        """The whole file (see :meth:`open`)."""
        with self.open(name) as source:
            return source.read()

    def write(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` whole: a fresh temporary file renamed over it
        (a link in its place is replaced, never followed)."""
        target = self.path(name)
        temp = self.path(f"{name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(temp, _WRITE_NEW, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def create(self, name: str, data: bytes) -> None:
        """Write a new file; FileExistsError when ``name`` exists."""
        fd = os.open(self.path(name), _WRITE_NEW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)

    def remove(self, name: str) -> None:
        """Delete ``name`` and its owner mark (a link is removed, not followed)."""
        self.path(name).unlink(missing_ok=True)
        self.path(name + OWNER_SUFFIX).unlink(missing_ok=True)


def _regular(fd: int, name: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePath("file", f"{name!r} is not a regular file", value=name)
    return info


class ResultFile:
    """A run's output, locked for appending; ``done`` holds the line numbers it already
    has, ``records`` what they say.

    Created here with its owner mark, or opened again only when the mark names this run
    and this very file (an empty file is adopted: a crash may fall between the two). A
    line torn by a crash is cut off; any other file is refused before a byte changes.
    """

    def __init__(self, files: FilesDir, name: str, *, run: str) -> None:
        path = files.path(name)
        mark = files.path(name + OWNER_SUFFIX)
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:  # ELOOP: a link in its place
            raise UnsafePath("output", f"{name!r} cannot be opened safely: {exc}") from None
        self.file: IO[bytes] = os.fdopen(fd, "a+b")
        try:
            info = _regular(fd, name)
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BulkBusy(name) from None
            owner = {"run": run, "dev": info.st_dev, "ino": info.st_ino}
            if _mark(files, name + OWNER_SUFFIX) != owner:
                if info.st_size:
                    raise UnsafePath(
                        "output", f"{name!r} exists and was not created by bulk run {run!r}"
                    )
                files.write(mark.name, orjson.dumps(owner))
            self._load()
        except BaseException:
            self.file.close()
            raise

    def _load(self) -> None:
        self.file.seek(0)
        data = self.file.read()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):  # a line torn by a crash: it is redone
            self.file.truncate(whole)
        self.records: list[dict[str, Any]] = [
            orjson.loads(raw) for raw in data[:whole].splitlines() if raw
        ]
        self.done = {int(record["line"]) for record in self.records}

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(orjson.dumps(record) + b"\n")
        self.file.flush()

    def __enter__(self) -> ResultFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _mark(files: FilesDir, name: str) -> Any:
    try:
        return orjson.loads(files.read(name))
    except (OSError, orjson.JSONDecodeError):
        return None
