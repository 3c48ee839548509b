"""An in-memory storage backend (a test double, and the model of a new backend): this one module
plus one ``REGISTRY.register(("dict",), "tests.unit.storage.dict_storage:DictStorage")`` line is
all a backend needs. Its objects live in the dict handed over as ``storage_options={"objects": d}``
(keys are full ``dict://`` paths), so each test owns its store."""

from __future__ import annotations

import io
import posixpath
from collections.abc import Mapping
from typing import Any

from solosave._src.storage.base import Commit, Data, DataFile, Storage, joined

SCHEME = "dict://"


class DictCommit(Commit):
    """One assignment into the dict is the commit (like one PUT)."""

    def _write_aside(self, data: Data) -> None:
        self._data = bytes(joined(data))

    def _finish(self) -> None:
        self.storage.objects[self.path] = self._data

    def _discard(self) -> None:
        self._data = b""


class DictFile(DataFile):
    def __init__(self, storage: DictStorage, path: str) -> None:
        self.storage, self.path, self.buf, self.closed = storage, path, io.BytesIO(), False

    def write(self, b: Any) -> int:
        return self.buf.write(bytes(b))

    def tell(self) -> int:
        return self.buf.tell()

    def commit(self) -> None:
        self.storage.objects[self.path] = self.buf.getvalue()
        self.closed = True

    def close(self) -> None:
        self.closed = True


class DictStorage(Storage):
    commit_type = DictCommit

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    @classmethod
    def from_path(cls, path: str, options: Mapping[str, Any] | None = None) -> DictStorage:
        if not options or "objects" not in options:
            raise ValueError(f"{path}: pass storage_options={{'objects': {{}}}}")
        return cls(options["objects"])

    @classmethod
    def normalize(cls, path: Any) -> str:
        return SCHEME + str(path)[len(SCHEME):].rstrip("/")

    @classmethod
    def join(cls, base: Any, name: str) -> str:
        return f"{cls.normalize(base)}/{name}"

    @classmethod
    def basename(cls, path: Any) -> str:
        return posixpath.basename(cls.normalize(path))

    @classmethod
    def dirname(cls, path: Any) -> str:
        return SCHEME + posixpath.dirname(cls.normalize(path)[len(SCHEME):])

    def _under(self, path: str) -> list[str]:
        prefix = self.normalize(path) + "/"
        return [k for k in self.objects if k.startswith(prefix)]

    def exists(self, path: str) -> bool:
        return path in self.objects or bool(self._under(path))

    def isdir(self, path: str) -> bool:
        return bool(self._under(path))

    def isfile(self, path: str) -> bool:
        return path in self.objects

    def listdir(self, path: str) -> list[str]:
        names = {k[len(self.normalize(path)) + 1:].split("/", 1)[0] for k in self._under(path)}
        if not names:
            raise FileNotFoundError(path)
        return sorted(names)

    def size(self, path: str) -> int:
        return len(self.read(path))

    def read(self, path: str) -> bytes:
        try:
            return self.objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return self.read(path)[offset:offset + length]

    def open_read(self, path: str) -> io.BytesIO:
        return io.BytesIO(self.read(path))

    def makedirs(self, path: str) -> None:
        pass

    def open_data(self, path: str, *, fsync: bool = True, part_size: int = 16 << 20,
                  concurrency: int = 8) -> DictFile:
        return DictFile(self, path)

    def remove(self, path: str) -> None:
        self.objects.pop(path, None)

    def remove_tree(self, path: str) -> None:
        for k in self._under(path):
            del self.objects[k]
