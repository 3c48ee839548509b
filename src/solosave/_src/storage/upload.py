"""Streaming one data file to object storage (background worker, one upload per data file).

:meth:`solosave.FileWriter.open` returns an :class:`ObjectUpload` (the fsspec backend's
:class:`~solosave._src.storage.base.DataFile`) for a URL instead of a local file. It is a
write-only stream with one difference from a file: the object appears, whole, only when
:meth:`ObjectUpload.commit` returns, and :meth:`ObjectUpload.close` without a commit abandons
it (nothing appears; a multipart upload is aborted). Called in this order, from one writer
thread: ``write`` / ``write_stable`` per piece of a record -> ``commit`` (or ``close`` on an
error).

On S3 (:class:`S3Upload`) the bytes go out as a multipart upload whose parts are sent
concurrently (at most ``concurrency`` in flight per file) while the writer goes on: memory is
bounded by the parts in flight. A part is a list of views, never a joined buffer:
``write_stable`` views (the staged tensor bytes, which stay valid and unchanged until the
upload ends) and ``bytes`` objects are sent without a copy; anything else written is copied
once (it may be a buffer its writer reuses: ``torch.save`` passes views of its own memory).
Every other fsspec filesystem gets :class:`StreamUpload` (its own ``open(path, "wb")``).

Errors of the storage client are translated by :func:`storage_error` into the built-in
``OSError`` family, with the fix in the message (credentials, endpoint).
"""

from __future__ import annotations

import asyncio
import io
from collections import deque
from typing import Any

from solosave._src.storage.base import DataFile

#: S3's smallest part (every part but the last).
MIN_PART = 5 << 20
#: S3's largest part number.
MAX_PARTS = 10_000
#: Parts per size step: part ``n`` is ``part_size * 2 ** ((n - 1) // PARTS_PER_STEP)`` bytes, so
#: 10,000 parts of a 16 MiB base hold about 1 TiB while small files keep small parts.
PARTS_PER_STEP = 2000
#: Bound of the wait for one part (each attempt is bounded by the client's own timeouts).
PART_WAIT_S = 1800.0


def storage_error(e: BaseException, url: str) -> BaseException | None:
    """``e`` as the built-in error it means, with a hint; ``None``: keep ``e`` as it is."""
    if isinstance(e, PermissionError):
        return PermissionError(f"access denied to {url}: {e}. Check the credentials "
                               "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or storage_options key/secret) "
                               "and that they may list, read, write and delete under this prefix")
    if isinstance(e, OSError):
        return None
    name, module = type(e).__name__, type(e).__module__
    if "Credential" in name:
        return PermissionError(f"no usable credentials for {url}: {e}. Set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, or pass storage_options={'key': ..., 'secret': ...}")
    if module.startswith(("botocore", "aiobotocore", "aiohttp", "urllib3")) or isinstance(e, TimeoutError):
        return ConnectionError(f"cannot reach the storage of {url}: {name}: {e}. Check the endpoint "
                               "(AWS_ENDPOINT_URL, or storage_options={'client_kwargs': {'endpoint_url': ...}}) "
                               "and the network")
    return None


class _Body(io.RawIOBase):
    """A list of byte views read as one seekable file, without joining them (a part's body)."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._size = sum(v.nbytes for v in views)
        self._pos = 0
        self._at = (0, 0)  # (view index, offset in it) of self._pos

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        left, i = self._pos, 0
        while i < len(self._views) and left >= self._views[i].nbytes:
            left -= self._views[i].nbytes
            i += 1
        self._at = (i, left)
        return self._pos

    def _slices(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes (fewer at the end) as slices of the views; advances."""
        out: list[memoryview] = []
        i, off = self._at
        while n > 0 and i < len(self._views):
            view = self._views[i]
            k = min(view.nbytes - off, n)
            out.append(view[off:off + k])
            n -= k
            off += k
            self._pos += k
            if off == view.nbytes:
                i, off = i + 1, 0
        self._at = (i, off)
        return out

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        for piece in self._slices(len(out)):
            out[done:done + piece.nbytes] = piece
            done += piece.nbytes
        return done

    def read(self, size: int | None = -1) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else size
        return b"".join(self._slices(n))  # one copy, of this chunk only


class ObjectUpload(DataFile):
    """A write-only stream whose object appears only at :meth:`commit` (see the module doc)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.closed = False
        self._pos = 0

    def write(self, b: Any) -> int:
        """Write a copy of ``b`` (``bytes`` are kept as they are: they cannot change)."""
        data = b if type(b) is bytes else bytes(b)
        return self._add(memoryview(data))

    def write_stable(self, b: Any) -> int:
        """Write ``b`` without a copy: the caller keeps it valid and unchanged until
        :meth:`commit` or :meth:`close` returns."""
        return self._add(memoryview(b).cast("B"))

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Nothing to do: bytes leave as parts fill, and the object appears at commit."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.url} is an object upload, not a file")

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def _add(self, view: memoryview) -> int:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class StreamUpload(ObjectUpload):
    """Any fsspec filesystem: its own buffered ``open(url, "wb")``; an abandoned file is
    removed again."""

    def __init__(self, fs: Any, url: str) -> None:
        super().__init__(url)
        self._fs = fs
        self._f = fs.open(url, "wb")

    def write_stable(self, b: Any) -> int:
        return self.write(b)

    def _add(self, view: memoryview) -> int:
        self._f.write(view)
        self._pos += view.nbytes
        return view.nbytes

    def commit(self) -> None:
        self._f.close()
        self.closed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._f.close()
        finally:
            try:
                self._fs.rm_file(self.url)
            except OSError:
                pass


class S3Upload(ObjectUpload):
    """A concurrent multipart upload to S3 through s3fs (its client, retries and event loop).

    The upload starts with the first full part; a file smaller than one part is one PUT at
    commit. ``part_size``: the first parts' size (at least 5 MiB); ``concurrency``: parts in
    flight at once, which bounds this file's memory to about ``concurrency`` parts."""

    def __init__(self, fs: Any, url: str, part_size: int, concurrency: int) -> None:
        super().__init__(url)
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(url)
        self._base = max(int(part_size), MIN_PART)
        self._limit = max(int(concurrency), 1)
        self._segs: deque[memoryview] = deque()
        self._pending = 0
        self._next = 1
        self._upload_id: str | None = None
        self._inflight: deque[tuple[int, Any]] = deque()
        self._parts: list[dict[str, Any]] = []

    def _part_size(self) -> int:
        return self._base << min((self._next - 1) // PARTS_PER_STEP, 8)

    def _add(self, view: memoryview) -> int:
        n = view.nbytes
        if n:
            self._segs.append(view)
            self._pending += n
            self._pos += n
            while self._pending >= self._part_size():
                self._send(self._take(self._part_size()))
        return n

    def _take(self, n: int) -> list[memoryview]:
        out: list[memoryview] = []
        need = n
        while need:
            seg = self._segs[0]
            if seg.nbytes <= need:
                out.append(self._segs.popleft())
                need -= seg.nbytes
            else:
                out.append(seg[:need])
                self._segs[0] = seg[need:]
                need = 0
        self._pending -= n
        return out

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)
        except Exception as e:
            raise (storage_error(e, self.url) or e) from e

    def _send(self, views: list[memoryview]) -> None:
        if self._next > MAX_PARTS:
            raise OSError(f"{self.url}: more than {MAX_PARTS} parts; use more files per rank (workers)")
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        while len(self._inflight) >= self._limit:
            self._finish_oldest()
        # s3fs's coroutine (its retries and error translation), run on fsspec's I/O loop so that
        # several parts are in flight while this thread goes on writing
        coro = self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                                 PartNumber=self._next, Body=_Body(views))
        self._inflight.append((self._next, asyncio.run_coroutine_threadsafe(coro, self._fs.loop)))
        self._next += 1

    def _finish_oldest(self) -> None:
        number, future = self._inflight.popleft()
        try:
            out = future.result(timeout=PART_WAIT_S)
        except Exception as e:
            future.cancel()
            raise (storage_error(e, self.url) or e) from e
        self._parts.append({"PartNumber": number, "ETag": out["ETag"]})

    def commit(self) -> None:
        """Send the rest, wait for every part, complete the object (it appears now, whole)."""
        if self.closed:
            raise ValueError(f"{self.url}: upload already closed")
        try:
            if self._upload_id is None:
                self._call("put_object", Body=_Body(list(self._segs)))
            else:
                if self._pending:
                    self._send(self._take(self._pending))
                while self._inflight:
                    self._finish_oldest()
                self._call("complete_multipart_upload", UploadId=self._upload_id,
                           MultipartUpload={"Parts": self._parts})
        except BaseException:
            self.close()  # abort: no parts left behind
            raise
        self.closed = True
        self._segs.clear()
        self._fs.invalidate_cache(self.url)

    def close(self) -> None:
        """Abandon the upload if it was not committed: wait for the parts in flight (they read
        the caller's buffers), then abort it; never raises."""
        if self.closed:
            return
        self.closed = True
        for _, future in self._inflight:
            try:
                future.result(timeout=PART_WAIT_S)
            except Exception:  # noqa: BLE001, S110 - the upload is being abandoned anyway
                future.cancel()
        self._inflight.clear()
        self._segs.clear()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001, S110 - an unfinished upload holds no visible object
                pass
