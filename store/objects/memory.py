"""A store in this process's memory (memory://NAME), for tests and quick experiments.

Backed by fsspec's `MemoryFileSystem`, so every `Store("memory://x")` in one process sees the
same objects. Conditional writes and pointer swaps are serialised by one in-process lock;
nothing here is visible to other processes.
"""

from __future__ import annotations

import threading

from fsspec.implementations.memory import MemoryFileSystem

from store.errors import PointerConflict
from store.objects.base import Cell, Listing, ObjectStore

# One lock for all memory stores: fsspec's memory filesystem is itself one per process.
_LOCK = threading.RLock()


class MemoryObjects(ObjectStore):
    """Objects in fsspec's process-wide memory filesystem under `/NAME`."""

    def __init__(self, name: str) -> None:
        self.fs = MemoryFileSystem()
        self.root = "/" + name.strip("/")
        self.url = f"memory://{name.strip('/')}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}".rstrip("/")

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=start, end=start + length))

    def size(self, key: str) -> int | None:
        path = self._path(key)
        if not self.fs.isfile(path):
            return None
        return int(self.fs.size(path))

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with _LOCK:
            if self.fs.exists(self._path(key)):
                return False
            self.put(key, data)
            return True

    def list(self, prefix: str) -> Listing:
        listing = Listing()
        try:
            entries = self.fs.ls(self._path(prefix), detail=True)
        except FileNotFoundError:
            return listing
        for entry in sorted(entries, key=lambda e: e["name"]):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] == "directory":
                listing.dirs.append(name)
            else:
                listing.files[name] = int(entry["size"])
        return listing

    def delete(self, key: str) -> bool:
        with _LOCK:
            if not self.fs.isfile(self._path(key)):
                return False
            self.fs.rm_file(self._path(key))
            return True

    def delete_prefix(self, prefix: str) -> int:
        path = self._path(prefix)
        if not self.fs.exists(path):
            return 0
        count = len(self.fs.find(path))
        self.fs.rm(path, recursive=True)
        return count

    def read_cell(self, key: str) -> Cell:
        path = self._path(key)
        data = self.fs.cat_file(path) if self.fs.isfile(path) else None
        return Cell(data=data, token=data)

    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        with _LOCK:
            current = self.read_cell(key).data
            if current != token:
                raise PointerConflict(
                    f"{self.url}/{key} changed while this writer held {token!r}; found "
                    f"{current!r}. Re-read the pointer and decide again"
                )
            self.put(key, data)
