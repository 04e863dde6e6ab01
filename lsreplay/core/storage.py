"""The run's store: byte, JSON and tensor entries under one root, local or S3, over fsspec.

Every artefact a run keeps (checkpoints, replay shards, manifests) goes through a Store, so
that a step can be resumed from any process that can reach the root. Writes are atomic: a
reader sees either the previous entry or the complete new one, never a partial file.
Entries are described by small dicts {"key", "uri", "sha256", "bytes"} that manifests carry,
so a reader can check it got exactly what the writer wrote. torch is imported where tensors
are written or read: a process that only holds the run's lease (lsreplay.core.run_lock)
starts without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import functools
import hashlib
import json
import logging
import math
import os
import posixpath
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem
from safetensors import SafetensorError

from lsreplay.core import faults
from lsreplay.core.config import redact_url

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are read or written
    import torch

log = logging.getLogger(__name__)

# Errors a remote client raises when it cannot talk to its endpoint. The S3 client is an
# optional dependency: a local-only install has none, and nothing remote can fail then.
_REMOTE_ERRORS: tuple[type[BaseException], ...] = ()
_NOT_RETRIED: tuple[type[BaseException], ...] = ()
with contextlib.suppress(ImportError):
    from botocore.exceptions import BotoCoreError, EndpointConnectionError

    _REMOTE_ERRORS += (BotoCoreError,)
    # The S3 client has already retried these with backoff before giving up: do not multiply.
    _NOT_RETRIED += (EndpointConnectionError,)
with contextlib.suppress(ImportError):
    from aiohttp import ClientError as AiohttpClientError

    _REMOTE_ERRORS += (AiohttpClientError,)

# Transient failures (a dropped connection, a throttled request, an endpoint briefly down)
# are retried with exponential backoff before an operation gives up: this many retries,
# the first after this many seconds. The environment can change both (tests shorten them).
RETRIES_ENV, BACKOFF_ENV = "LSREPLAY_STORAGE_RETRIES", "LSREPLAY_STORAGE_BACKOFF"
DEFAULT_RETRIES, DEFAULT_BACKOFF = 3, 0.5

# Marks the temporary file of a local write in progress; list() hides such files, which a
# writer killed between write and rename leaves behind (sweep_interrupted_writes removes them).
_TMP_MARK = ".lsreplay-tmp-"

# An S3 entry larger than a part goes up as a multipart upload, a part at a time from the
# entry's pieces (never the whole entry copied in memory), up to the filesystem's
# max_concurrency parts at once. A writer killed in the middle leaves an incomplete upload,
# which sweep_interrupted_writes aborts; a smaller entry is one PUT, which S3 publishes only
# once complete, so a killed one leaves nothing. S3 parts are at least 5 MiB (the last one
# excepted) and at most 10,000; the environment can set the size (tests make it small).
PART_BYTES_ENV = "LSREPLAY_STORAGE_PART_BYTES"
DEFAULT_PART_BYTES, MIN_PART_BYTES, MAX_PARTS = 64 * 2**20, 5 * 2**20, 10_000

# This process's writes in progress: temporary file paths and S3 upload ids. A sweep of
# interrupted writes leaves them alone, whichever thread writes them.
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


# Per store URI, a check this process makes before every write and delete there: the run's
# lease (lsreplay.core.run_lock), which raises once this process may no longer write. Called
# with commit=True before a commit write (an entry that makes work count).
_FENCES: dict[str, Callable[[bool], None]] = {}


def fence(uri: str, check: Callable[[bool], None] | None) -> None:
    """Make this process's writes and deletes to the store at `uri` (a Store's uri), from any
    thread, call check(commit) first; None: no longer."""
    if check is None:
        _FENCES.pop(uri, None)
    else:
        _FENCES[uri] = check


class StorageError(RuntimeError):
    """A store operation failed; the message names the URI and what to check."""


class MissingEntry(StorageError):
    """The key has no entry in the store."""


class CorruptEntry(StorageError):
    """The entry exists but its bytes are not what was written (hash or format check failed)."""


class Contended(StorageError):
    """A conditional write or delete found the entry not as it was told to expect it."""


class MalformedEntry(StorageError):
    """The entry is valid JSON, but not of the structure lsreplay writes there: another program
    or version wrote it, or a hand edited it. Nothing is guessed: the message names the entry
    and what to do."""


def is_file_record(obj) -> bool:
    """Whether `obj` has the shape of the record of a written entry, as manifests list them
    ({"key", "bytes", "sha256", ...})."""
    return isinstance(obj, dict) and isinstance(obj.get("key"), str) and isinstance(obj.get("bytes"), int) \
        and isinstance(obj.get("sha256"), str)


class Store:
    """A root (local directory or s3://bucket/prefix) holding entries under '/'-separated keys."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        options = dict(storage_options or {})
        fs, root = fsspec.url_to_fs(uri, **_with_defaults(uri, options))
        self._fs, self._options = fs, options
        self._local = isinstance(fs, LocalFileSystem)
        self._s3 = "s3" in fs.protocol
        self._root = os.path.normpath(root) if self._local else root.rstrip("/")
        self.uri = self._root if self._local else fs.unstrip_protocol(self._root)
        # Kept for error messages only, without credentials; those stay inside the filesystem object.
        self._endpoint = redact_url((options.get("client_kwargs") or {}).get("endpoint_url") or options.get(
            "endpoint_url", "the default endpoint"))

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def _fenced(self, commit: bool = False) -> None:
        if (check := _FENCES.get(self.uri)) is not None:
            check(commit)

    @property
    def options(self) -> dict:
        """The storage options the store was opened with (credentials included): for a process
        of lsreplay's own that opens it again (the lease's renewer), never to be written out."""
        return dict(self._options)

    @property
    def local(self) -> bool:
        """Whether the store is a local folder (its urls are paths)."""
        return self._local

    def url(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key)}"

    def exists(self, key: str) -> bool:
        path = self._path(key)

        def op() -> bool:
            try:
                return self._fs.info(path)["type"] == "file"
            except FileNotFoundError:
                return False

        return self._call(key, op)

    def size(self, key: str) -> int | None:
        """The entry's size in bytes, or None if there is no entry."""
        path = self._path(key)

        def op() -> int | None:
            try:
                info = self._fs.info(path)
            except FileNotFoundError:
                return None
            return int(info["size"]) if info["type"] == "file" else None

        return self._call(key, op)

    def write_bytes(self, key: str, data: bytes, commit: bool = False) -> dict:
        """`commit`: the entry makes work count (a done marker, a checkpoint's record): a fence
        on the store renews the run's lease first (`fence`)."""
        return self._write(key, [data], commit)

    def _write(self, key: str, pieces: list, commit: bool = False) -> dict:
        """Write the concatenation of `pieces` (bytes-like) as entry `key`. A local file is
        written piece by piece from them, hashed as it goes: both release the GIL, so a
        background writer never holds it through a copy of a large file. The store's fence
        is asked before the write starts and again before it is published."""
        path = self._path(key)
        digest, size = hashlib.sha256(), sum(memoryview(p).nbytes for p in pieces)

        def op() -> None:
            faults.storage_write(key)
            self._fenced(commit)
            if self._local:
                _write_local_atomic(path, pieces, lambda: faults.partly_written(key), self._fenced)
            elif self._s3 and size > _part_bytes(size):
                self._upload_multipart(path, pieces, size, lambda: faults.partly_written(key), self._fenced)
            else:
                # An object store publishes an object only once its upload completes.
                self._fs.pipe_file(path, b"".join(pieces))

        self._call(key, op)
        for piece in pieces:
            digest.update(piece)
        key = _check_key(key)
        log.debug("wrote %s (%d bytes)", self.url(key), size)
        return {"key": key, "uri": self.url(key), "sha256": digest.hexdigest(), "bytes": size}

    def link(self, entry: dict, key: str) -> dict:
        """Entry `key` with the bytes of the written `entry`, without moving them through this
        process: a hard link in a local store (a copy where links are refused), a server-side
        copy in an object store. Returns the new entry (same sha256 and size)."""
        source, path = self._path(entry["key"]), self._path(key)

        def op() -> None:
            faults.storage_write(key)
            self._fenced()
            if not self._local:
                self._fs.copy(source, path)
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
            with _write_in_progress(tmp):
                try:
                    os.link(source, tmp)
                except OSError:  # another file system, or links refused: copy
                    shutil.copyfile(source, tmp)
                os.replace(tmp, path)

        self._call(key, op)
        key = _check_key(key)
        return {**entry, "key": key, "uri": self.url(key)}

    def read_bytes(self, key: str, sha256: str | None = None) -> bytes:
        path = self._path(key)

        def op() -> bytes:
            try:
                return self._fs.cat_file(path)
            except FileNotFoundError as e:
                raise MissingEntry(
                    f"no entry {self.url(key)}: it was never written, or was deleted; "
                    "check the run directory and the manifest that pointed here"
                ) from e

        data = self._call(key, op)
        actual = _sha256(data) if sha256 is not None else None
        if actual != sha256:
            raise CorruptEntry(
                f"entry {self.url(key)} has sha256 {actual}, expected {sha256}: it was "
                "changed or damaged after writing; rewrite it or fall back to an earlier step"
            )
        return data

    def write_json(self, key: str, obj: object, commit: bool = False) -> dict:
        # Sorted keys give equal objects equal bytes, hence equal hashes. Compact: a step's
        # records are mostly token ids and logprobs, one per line indented (2.4x the bytes).
        return self.write_bytes(key, json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), commit)

    def read_json(self, key: str, sha256: str | None = None) -> object:
        data = self.read_bytes(key, sha256)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptEntry(f"entry {self.url(key)} is not valid JSON ({e}); rewrite it") from e

    def write_tensors(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> dict:
        return self._write(key, _safetensors_pieces(_standalone(tensors), metadata))

    def read_tensors(self, key: str, sha256: str | None = None) -> dict[str, torch.Tensor]:
        import safetensors.torch

        data = self.read_bytes(key, sha256)
        try:
            return safetensors.torch.load(data)
        except SafetensorError as e:
            raise CorruptEntry(
                f"entry {self.url(key)} is not a readable safetensors file ({e}); "
                "it was truncated or damaged: rewrite it or fall back to an earlier step"
            ) from e

    def list(self, prefix: str = "") -> list[str]:
        path = self._path(prefix) if prefix else self._root
        found = self._call(prefix, lambda: self._fs.find(path))
        keys = (posixpath.relpath(p, self._root) for p in found)
        return sorted(k for k in keys if _TMP_MARK not in posixpath.basename(k))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{key: size in bytes} of every entry under prefix, from one listing."""
        path = self._path(prefix) if prefix else self._root

        def op() -> dict:
            try:
                return self._fs.find(path, detail=True)
            except FileNotFoundError:
                return {}

        found = self._call(prefix, op)
        out = {}
        for p, info in found.items():
            key = posixpath.relpath(p, self._root)
            if info.get("type") == "file" and _TMP_MARK not in posixpath.basename(key):
                out[key] = int(info["size"])
        return out

    @contextlib.contextmanager
    def local_folder(self, prefix: str) -> Iterator[str]:
        """A local folder holding the entries under `prefix`, for a program that reads files
        (a vLLM engine loading a drafter): the store's own in a local store, else a copy,
        removed on exit."""
        if self._local:
            yield self._path(prefix)
            return
        with tempfile.TemporaryDirectory(prefix="lsreplay-store-") as folder:
            for key in self.sizes(prefix):
                # A key with a `..` part (an object store's keys are any strings) would land
                # outside the folder: refused before anything is opened or read.
                if not _valid_key(key):
                    raise CorruptEntry(f"the store {self.uri} holds an object named {key!r} under {prefix}: a key with "
                                       "an empty, '.' or '..' part, which lsreplay never writes and will not copy out "
                                       "(it would land outside the folder); delete that object")
                data = self.read_bytes(key)
                path = os.path.join(folder, posixpath.relpath(key, prefix))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            yield folder

    # -- conditional writes (object stores: a lease's create, renewal and release) ----------
    def write_if(self, key: str, data: bytes, etag: str | None) -> str:
        """Write entry `key` only if it is absent (`etag` None: S3's If-None-Match: *) or is
        still the version `etag` names (If-Match); returns the new version's ETag. Contended if
        not: another writer got there first."""
        bucket, path, _ = self._fs.split_path(self._path(key))
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        return self._call(key, lambda: self._conditional(key, "put_object", Bucket=bucket, Key=path, Body=data,
                                                         **condition))["ETag"]

    def read_versioned(self, key: str) -> tuple[bytes, str, float]:
        """Entry `key`'s bytes, ETag and age: seconds since it was last written, by the
        server's clock (its Last-Modified against its response's Date), whatever this
        machine's clock says. MissingEntry if there is none."""
        bucket, path, _ = self._fs.split_path(self._path(key))

        def op() -> tuple[bytes, str, float]:
            try:
                found = fsspec.asyn.sync(self._fs.loop, _get_object, self._fs, bucket, path)
            except FileNotFoundError as e:
                raise MissingEntry(f"no entry {self.url(key)}") from e
            now = email.utils.parsedate_to_datetime(found["ResponseMetadata"]["HTTPHeaders"]["date"])
            return found["Body"], found["ETag"], (now - found["LastModified"]).total_seconds()

        return self._call(key, op)

    def delete_if(self, key: str, etag: str) -> None:
        """Delete entry `key` only if it is still the version `etag` names; Contended if not."""
        bucket, path, _ = self._fs.split_path(self._path(key))
        self._call(key, lambda: self._conditional(key, "delete_object", Bucket=bucket, Key=path, IfMatch=etag))

    def _conditional(self, key: str, method: str, **request) -> dict:
        if not self._s3:
            raise NotImplementedError(f"conditional writes need an object store; {self.uri} is not one")
        try:
            return self._fs.call_s3(method, **request)
        except OSError as e:
            if isinstance(e, FileExistsError) or _precondition_failed(e.__cause__):
                raise Contended(f"{self.url(key)} changed under this writer ({method} with "
                                f"{', '.join(k for k in request if k.startswith('If'))} refused)") from None
            raise

    def delete(self, key: str) -> None:
        """Remove one entry; deleting an absent key is not an error, so cleanup can be rerun."""
        path = self._path(key)

        def op() -> None:
            self._fenced()
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(path)

        self._call(key, op)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every entry under prefix (a folder-like key, not a string prefix)."""
        if not prefix.strip("/"):
            raise ValueError(f"refusing to delete the whole store {self.uri}: give a prefix")
        path = self._path(prefix)

        def op() -> None:
            self._fenced()
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)

        self._call(prefix, op)

    def sweep_interrupted_writes(self) -> dict:
        """Remove what writes cut short (a killed process) left under the root: temporary
        files of local writes, incomplete multipart uploads in S3; never a write this process
        has in progress. Entries are untouched: a temporary file or an upload is no entry, and
        nothing names one. Returns {"files", "bytes", "uploads"}: what was removed. A store that
        refuses (e.g. no permission to list uploads) is left as it is, with a warning."""
        found = {"files": 0, "bytes": 0, "uploads": 0}
        try:
            if self._local:
                found.update(self._call("", self._remove_temporary_files))
            elif self._s3:
                found["uploads"] = self._call("", self._abort_incomplete_uploads)
        except StorageError as e:
            log.warning("could not remove what interrupted writes left in %s: %s", self.uri, e)
        if any(found.values()):
            log.info("removed what interrupted writes left in %s: %d temporary file(s) (%.1f MB), %d incomplete "
                     "upload(s)", self.uri, found["files"], found["bytes"] / 1e6, found["uploads"])
        return found

    def _remove_temporary_files(self) -> dict:
        self._fenced()
        files = size = 0
        for path, info in self._fs.find(self._root, detail=True).items():
            if _TMP_MARK in posixpath.basename(path) and not _writing(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    files, size = files + 1, size + int(info["size"])
        return {"files": files, "bytes": size}

    def _abort_incomplete_uploads(self) -> int:
        self._fenced()
        bucket, root, _ = self._fs.split_path(self._root)
        query = {"Bucket": bucket, "Prefix": f"{root}/" if root else ""}
        uploads = []
        while True:  # a page holds up to 1,000 uploads
            page = self._fs.call_s3("list_multipart_uploads", **query)
            uploads += [u for u in page.get("Uploads", []) if not _writing(u["UploadId"])]
            if not page.get("IsTruncated"):
                break
            query.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])
        for upload in uploads:
            self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return len(uploads)

    def _upload_multipart(self, path: str, pieces: list, size: int, midway: Callable[[], None],
                          publishing: Callable[[], None]) -> None:
        """Upload the `size` bytes of `pieces`, concatenated, to `path` in parts (_part_bytes);
        `midway()` runs once the first half of the parts are up, `publishing()` before the
        upload is completed (it may refuse)."""
        fs, part_bytes = self._fs, _part_bytes(size)
        bucket, key, _ = fs.split_path(path)
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        count, cut = math.ceil(size / part_bytes), _cut(pieces, part_bytes)

        def send(numbers: range) -> list[dict]:
            return fsspec.asyn.sync(fs.loop, _upload_parts, fs, bucket, key, upload_id, cut, numbers,
                                    fs.max_concurrency)

        with _write_in_progress(upload_id):
            try:
                parts = send(range(1, count // 2 + 1))
                midway()  # out of the filesystem's event loop: it may use the store
                parts += send(range(count // 2 + 1, count + 1))
                publishing()
                fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                           MultipartUpload={"Parts": parts})
            except BaseException:
                with contextlib.suppress(Exception):
                    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                raise
        fs.invalidate_cache(path)

    def _path(self, key: str) -> str:
        return f"{self._root}/{_check_key(key)}"

    def _call(self, key: str, op: Callable):
        """Run one filesystem operation; retry it with backoff while it fails transiently."""
        retries = int(os.environ.get(RETRIES_ENV, DEFAULT_RETRIES))
        backoff = float(os.environ.get(BACKOFF_ENV, DEFAULT_BACKOFF))
        for attempt in range(retries + 1):
            try:
                with self._errors(key):
                    return op()
            except StorageError as e:
                if attempt == retries or not _transient(e.__cause__):
                    raise
                delay = backoff * 2**attempt
                log.warning("%s; retrying in %.1f s (retry %d of %d)", e, delay, attempt + 1, retries)
                time.sleep(delay)
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turn filesystem and client failures into StorageError naming the URI, never secrets."""
        try:
            yield
        except StorageError:
            raise
        except _REMOTE_ERRORS as e:
            raise StorageError(
                f"cannot reach the store {self.uri} at {self._endpoint} ({type(e).__name__}) "
                f"while accessing {key!r}: check storage.endpoint_url, that the server is up, "
                "and the credentials"
            ) from e
        except PermissionError as e:
            raise StorageError(
                f"access denied to {self.url(key) if key else self.uri}: check the credentials "
                "and the bucket's permissions"
            ) from e
        except OSError as e:
            raise StorageError(f"I/O error on {self.url(key) if key else self.uri}: {e}") from e


# I/O errors that do not pass within a few seconds of backoff: a full disk or quota, a file
# over its size limit, a read-only file system. Failed at once, they stop a run where they
# happen instead of after a minute of retries.
_LASTING_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def _precondition_failed(error: BaseException | None) -> bool:
    """Whether S3 refused a request for its condition (or for a conditional write racing it)."""
    code = (getattr(error, "response", None) or {}).get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


async def _get_object(fs, bucket: str, key: str) -> dict:
    """An object's bytes and its response's metadata (s3fs's reads keep no headers)."""
    found = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    try:
        return {**found, "Body": await found["Body"].read()}
    finally:
        found["Body"].close()


def _transient(error: BaseException | None) -> bool:
    """A failure that may pass: a remote client's error, a dropped connection or timeout, or a
    generic I/O error; not a missing entry, a refused permission or a full disk."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, *_NOT_RETRIED)):
        return False
    if isinstance(error, OSError) and error.errno in _LASTING_ERRNOS:
        return False
    return isinstance(error, (*_REMOTE_ERRORS, ConnectionError, TimeoutError)) or type(error) is OSError


def _with_defaults(uri: str, options: dict) -> dict:
    """Add fsspec options every store needs: remote listings must not be served from a cache,
    because other processes of the run write to the same root."""
    if fsspec.core.split_protocol(uri)[0] not in (None, "file", "local"):
        options.setdefault("use_listings_cache", False)
    return options


def _valid_key(key: str) -> bool:
    """A relative '/'-separated path without empty, '.' or '..' parts, and no temporary file's."""
    return bool(key.strip("/")) and not any(p in ("", ".", "..") for p in key.strip("/").split("/")) \
        and _TMP_MARK not in key


def _check_key(key: str) -> str:
    if not _valid_key(key):
        raise ValueError(f"invalid store key {key!r}: use a relative '/'-separated path")
    return key.strip("/")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_local_atomic(path: str, pieces: list, midway: Callable[[], None], publishing: Callable[[], None]) -> None:
    """Write to a temporary file beside the target, flush it to disk, then rename over the
    target: a rename within one directory is atomic, so readers never see a partial file.
    `midway()` runs once the first half of the pieces are in the file, `publishing()` before
    the rename (it may refuse)."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{name}{_TMP_MARK}{uuid.uuid4().hex}")
    with _write_in_progress(tmp):
        try:
            with open(tmp, "wb") as f:
                for i, piece in enumerate(pieces):
                    if i == len(pieces) // 2:
                        f.flush()
                        midway()
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            publishing()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    # The rename itself lives in the directory; sync it so it survives a power loss.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _write_in_progress(name: str) -> Iterator[None]:
    with _WRITING_LOCK:
        _WRITING.add(name)
    try:
        yield
    finally:
        with _WRITING_LOCK:
            _WRITING.discard(name)


def _writing(name: str) -> bool:
    with _WRITING_LOCK:
        return name in _WRITING


def _part_bytes(size: int) -> int:
    """The size of an S3 upload's parts for an entry of `size` bytes."""
    wanted = int(os.environ.get(PART_BYTES_ENV, DEFAULT_PART_BYTES))
    if wanted < MIN_PART_BYTES:
        raise ValueError(f"{PART_BYTES_ENV}={wanted}: S3 parts are at least {MIN_PART_BYTES} bytes (5 MiB)")
    return max(wanted, math.ceil(size / MAX_PARTS))


def _cut(pieces: Iterable, part_bytes: int) -> Iterator[bytes]:
    """The concatenation of `pieces` in parts of `part_bytes` (the last one shorter), each
    part copied once from the pieces as it is wanted."""
    part: list[memoryview] = []
    filled = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            take = view[:part_bytes - filled]
            part.append(take)
            filled += take.nbytes
            view = view[take.nbytes:]
            if filled == part_bytes:
                yield b"".join(part)
                part, filled = [], 0
    if part:
        yield b"".join(part)


async def _upload_parts(fs, bucket: str, key: str, upload_id: str, parts: Iterator[bytes], numbers: range,
                        concurrency: int) -> list[dict]:
    """Upload the next parts of multipart upload `upload_id` as part `numbers`, up to
    `concurrency` at once (a part is cut from the pieces only when it can go). Returns the
    parts' numbers and ETags, in order, to complete the upload with."""
    slots = asyncio.Semaphore(concurrency)

    async def upload(number: int, body: bytes) -> dict:
        try:
            done = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                     Body=body)
            return {"PartNumber": number, "ETag": done["ETag"]}
        finally:
            slots.release()

    sent: list[asyncio.Future] = []
    try:
        for number in numbers:
            await slots.acquire()
            sent.append(asyncio.ensure_future(upload(number, next(parts))))
        return list(await asyncio.gather(*sent))
    except BaseException:
        for future in sent:
            future.cancel()
        raise


@functools.cache
def _safetensors_dtypes() -> dict:
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}


def _safetensors_pieces(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> list:
    """A safetensors file as pieces: its header, then every tensor's own memory (no copy).
    As safetensors itself does, the widest dtypes come first, so that every tensor starts at
    a multiple of its item size (the header is padded to 8 bytes)."""
    import safetensors.torch
    import torch

    dtypes = _safetensors_dtypes()
    if any(t.dtype not in dtypes for t in tensors.values()):
        return [safetensors.torch.save(tensors, metadata)]
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text,
            *(tensors[name].reshape(-1).view(torch.uint8).numpy() for name in order)]


def _standalone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors with one storage each, as safetensors requires: a tensor
    sharing storage with an earlier one (a view, a tied weight) is written as its own copy."""
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"cannot store {name!r}: it is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().cpu()  # a copy off an accelerator; the same tensor on the CPU
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(ptr)
        out[name] = t
    return out
