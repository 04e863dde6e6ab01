"""The run's store: byte, JSON and tensor entries under one root, local or S3, over fsspec.

Every artefact a run keeps (checkpoints, replay shards, manifests) goes through a Store, so
that a step can be resumed from any process that can reach the root. Writes are atomic: a
reader sees either the previous entry or the complete new one, never a partial file.
Entries are described by small dicts {"key", "uri", "sha256", "bytes"} that manifests carry,
so a reader can check it got exactly what the writer wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable, Iterator

import fsspec
import safetensors.torch
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import SafetensorError

from lsreplay import faults

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
# writer killed between write and rename leaves behind.
_TMP_MARK = ".lsreplay-tmp-"


class StorageError(RuntimeError):
    """A store operation failed; the message names the URI and what to check."""


class MissingEntry(StorageError):
    """The key has no entry in the store."""


class CorruptEntry(StorageError):
    """The entry exists but its bytes are not what was written (hash or format check failed)."""


class Store:
    """A root (local directory or s3://bucket/prefix) holding entries under '/'-separated keys."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        options = dict(storage_options or {})
        fs, root = fsspec.url_to_fs(uri, **_with_defaults(uri, options))
        self._fs = fs
        self._local = isinstance(fs, LocalFileSystem)
        self._root = os.path.normpath(root) if self._local else root.rstrip("/")
        self.uri = self._root if self._local else fs.unstrip_protocol(self._root)
        # Kept for error messages only; the credentials stay inside the filesystem object.
        self._endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get(
            "endpoint_url", "the default endpoint"
        )

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

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

    def write_bytes(self, key: str, data: bytes) -> dict:
        return self._write(key, [data])

    def _write(self, key: str, pieces: list) -> dict:
        """Write the concatenation of `pieces` (bytes-like) as entry `key`. A local file is
        written piece by piece from them, hashed as it goes: both release the GIL, so a
        background writer never holds it through a copy of a large file."""
        path = self._path(key)
        digest, size = hashlib.sha256(), sum(memoryview(p).nbytes for p in pieces)

        def op() -> None:
            faults.storage_write(key)
            if self._local:
                _write_local_atomic(path, pieces)
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
            if not self._local:
                self._fs.copy(source, path)
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
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

    def write_json(self, key: str, obj: object) -> dict:
        # Sorted keys give equal objects equal bytes, hence equal hashes.
        return self.write_bytes(key, json.dumps(obj, sort_keys=True, indent=1).encode())

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

    def delete(self, key: str) -> None:
        """Remove one entry; deleting an absent key is not an error, so cleanup can be rerun."""
        path = self._path(key)

        def op() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(path)

        self._call(key, op)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every entry under prefix (a folder-like key, not a string prefix)."""
        if not prefix.strip("/"):
            raise ValueError(f"refusing to delete the whole store {self.uri}: give a prefix")
        path = self._path(prefix)

        def op() -> None:
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)

        self._call(prefix, op)

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


def _transient(error: BaseException | None) -> bool:
    """A failure that may pass: a remote client's error, a dropped connection or timeout, or a
    generic I/O error; not a missing entry or a refused permission."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, *_NOT_RETRIED)):
        return False
    return isinstance(error, (*_REMOTE_ERRORS, ConnectionError, TimeoutError)) or type(error) is OSError


def _with_defaults(uri: str, options: dict) -> dict:
    """Add fsspec options every store needs: remote listings must not be served from a cache,
    because other processes of the run write to the same root."""
    if fsspec.core.split_protocol(uri)[0] not in (None, "file", "local"):
        options.setdefault("use_listings_cache", False)
    return options


def _check_key(key: str) -> str:
    parts = key.strip("/").split("/")
    if not key.strip("/") or any(p in ("", ".", "..") for p in parts) or _TMP_MARK in key:
        raise ValueError(f"invalid store key {key!r}: use a relative '/'-separated path")
    return "/".join(parts)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_local_atomic(path: str, pieces: list) -> None:
    """Write to a temporary file beside the target, flush it to disk, then rename over the
    target: a rename within one directory is atomic, so readers never see a partial file."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{name}{_TMP_MARK}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
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


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def _safetensors_pieces(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> list:
    """A safetensors file as pieces: its header, then every tensor's own memory (no copy).
    As safetensors itself does, the widest dtypes come first, so that every tensor starts at
    a multiple of its item size (the header is padded to 8 bytes)."""
    if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        return [safetensors.torch.save(tensors, metadata)]
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text,
            *(tensors[name].reshape(-1).view(torch.uint8).numpy() for name in order)]


def _standalone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors with one storage each, as safetensors requires: a tensor
    sharing storage with an earlier one (a view, a tied weight) is written as its own copy."""
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
