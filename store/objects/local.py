"""A store in a local folder (a path or file://PATH).

Whole-object writes go to a temporary file in the same folder, are fsynced and renamed into
place, so a reader (or a publisher killed mid-write) never leaves a half-written object under
its real name. Create-only writes use a hard link, which fails if the name exists. The
pointer cell is swapped under an exclusive `fcntl` lock on a lock file beside it. This
module must never follow a key outside its root: keys are validated by `store.layout`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from store.errors import PointerConflict
from store.objects.base import Cell, Listing, ObjectStore, transient_os_errors

_TEMP_MARK = ".tmp-"
LOCK_SUFFIX = ".lock"


class LocalObjects(ObjectStore):
    """Objects as files under `root` (created on first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> bytes:
        with transient_os_errors(f"{self.url}/{key}"):
            return self._path(key).read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with transient_os_errors(f"{self.url}/{key}"), open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _write_temp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}{_TEMP_MARK}{uuid.uuid4().hex}")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return temp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with transient_os_errors(f"{self.url}/{key}"):
            temp = self._write_temp(path, data)
            os.replace(temp, path)
            _fsync_dir(path.parent)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with transient_os_errors(f"{self.url}/{key}"):
            temp = self._write_temp(path, data)
            try:
                os.link(temp, path)
            except FileExistsError:
                return False
            finally:
                temp.unlink()
            _fsync_dir(path.parent)
        return True

    def list(self, prefix: str) -> Listing:
        folder = self._path(prefix) if prefix else self.root
        listing = Listing()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return listing
        for entry in sorted(entries, key=lambda e: e.name):
            if _TEMP_MARK in entry.name:
                continue
            if entry.is_dir():
                listing.dirs.append(entry.name)
            elif entry.is_file():
                listing.files[entry.name] = entry.stat().st_size
        return listing

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        folder = self._path(prefix)
        if not folder.is_dir():
            return 0
        count = sum(len(files) for _, _, files in os.walk(folder))
        shutil.rmtree(folder)
        return count

    def read_cell(self, key: str) -> Cell:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            data = None
        return Cell(data=data, token=data)

    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        path = self._path(key)
        with _exclusive_lock(path.with_name(path.name + LOCK_SUFFIX)):
            current = self.read_cell(key).data
            if current != token:
                raise PointerConflict(
                    f"{path} changed while this writer held {token!r}; found {current!r}. "
                    "Re-read the pointer and decide again"
                )
            self.put(key, data)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
