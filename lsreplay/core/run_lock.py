"""One writer per run: the lock a process holds for as long as it runs a run.

Two processes on one run would undo each other: the second's sweep deletes the first's
temporary files and aborts its uploads, its rewind deletes the first's policy markers, and
lines of metrics.jsonl are lost between their read-modify-writes. So `lsreplay train`,
`resume` and every flow run hold the run's lock, `run.lock` at the root of its store:

- a local store: an advisory lock (flock) on that file, which dies with its process; the
  file names the holder (host, pid, since) for the message a second process gets.
- S3: a lease, the object itself, created with a conditional PUT (If-None-Match: *) and
  renewed every LEASE_SECONDS / 3 with a PUT on its ETag (If-Match). A holder that stops
  renewing loses it LEASE_SECONDS after its last renewal, by the server's clock; a holder on
  this host whose process is gone loses it at once. Another process then takes it over with
  a PUT on the ETag it read, and the former holder's next renewal is refused: it stops its
  run (RunLockLost, at the next step). Released with a conditional DELETE.

Within a process the lock is reentrant: the command takes it (and waits with --wait) before
its flow starts, and the flow takes it again.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from lsreplay.core.config import ConfigError
from lsreplay.core.storage import Contended, MissingEntry, StorageError, Store

log = logging.getLogger(__name__)

LOCK_KEY = "run.lock"
# An S3 lease's life without renewal; the environment sets it (tests make it short).
LEASE_ENV, LEASE_SECONDS = "LSREPLAY_RUN_LEASE_SECONDS", 60.0
# How often a process that waits for the lock (--wait) tries again.
POLL_SECONDS = 2.0


class RunLocked(ConfigError):
    """Another process holds the run's lock: the message names it (the command exits 2)."""


class RunLockLost(RuntimeError):
    """The run's S3 lease was taken over, or could not be renewed for its whole life: another
    process may be writing the run now, so this one stops."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    since: str  # ISO time the holder took the lock
    id: str  # one per taking: tells a holder's own lease from another's
    renewals: int = 0

    @staticmethod
    def me() -> Holder:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return Holder(socket.gethostname(), os.getpid(), now, uuid.uuid4().hex)

    @staticmethod
    def parse(data: bytes) -> Holder | None:
        try:
            return Holder(**json.loads(data))
        except (ValueError, TypeError):  # empty (a holder starting) or another writer's
            return None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since}"

    def gone(self) -> bool:
        """Whether this is a process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's: it runs
            return False
        return False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


# The holder of a lock file that is still empty: a process that has just taken it.
STARTING = Holder("", 0, "", "")

# The locks this process holds, by store URI: a block inside the one that took a lock holds
# it too, and the outer block lets it go.
_HELD: dict[str, _Lock] = {}
_HELD_LOCK = threading.Lock()


@contextlib.contextmanager
def hold(store: Store, wait: bool = False) -> Iterator[_Lock]:
    """Hold the lock of the run in `store` for the block: RunLocked naming the holder if
    another process has it, or with `wait`, once that one lets it go."""
    with _HELD_LOCK:
        taken = _HELD.get(store.uri)
    if taken is not None:
        yield taken
        return
    lock = _FileLock(store) if store.local else _Lease(store)
    _acquire(lock, store, wait)
    with _HELD_LOCK:
        _HELD[store.uri] = lock
    try:
        yield lock
    finally:
        with _HELD_LOCK:
            del _HELD[store.uri]
        lock.release()


def _acquire(lock: _Lock, store: Store, wait: bool) -> None:
    waiting = False
    while (holder := lock.try_acquire()) is not None:
        who = "a process that is starting" if holder == STARTING else holder.describe()
        if not wait:
            raise RunLocked(f"the run at {store.uri} is being run by another process ({who}): one writer per run. "
                            "Wait for it to end (--wait waits for it), or stop it first")
        if not waiting:
            log.warning("the run at %s is being run by another process (%s); waiting for it to end", store.uri, who)
            waiting = True
        time.sleep(POLL_SECONDS)
    log.info("holding the lock of the run at %s", store.uri)


class _Lock:
    def try_acquire(self) -> Holder | None:
        """Take the lock: None, or the holder that has it."""
        raise NotImplementedError

    def check(self) -> None:
        """RunLockLost if the lock is no longer this process's."""

    def release(self) -> None:
        raise NotImplementedError


class _FileLock(_Lock):
    """flock on the run folder's run.lock; the file holds the holder's record. A releasing
    holder deletes the file while it holds it: a process that locked the deleted file sees
    that its path now names another file (or none) and tries again."""

    def __init__(self, store: Store):
        self.path = Path(store.uri) / LOCK_KEY
        self.fd: int | None = None

    def try_acquire(self) -> Holder | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):  # else released meanwhile: try again
                    return Holder.parse(self.path.read_bytes()) or STARTING
                continue
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, Holder.me().encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return None

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)  # and with it the lock


class _Lease(_Lock):
    """The run's lease in an object store (see the module's docstring)."""

    def __init__(self, store: Store):
        self.store = store
        self.lease = float(os.environ.get(LEASE_ENV, LEASE_SECONDS))
        self.holder = Holder.me()
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def try_acquire(self) -> Holder | None:
        while True:
            try:
                self.etag = self.store.write_if(LOCK_KEY, self.holder.encode(), None)
                break
            except Contended:
                pass
            try:
                data, etag, age = self.store.read_versioned(LOCK_KEY)
            except MissingEntry:  # released meanwhile: try again
                continue
            holder = Holder.parse(data) or Holder("(a writer not of lsreplay)", 0, "?", "")
            if age <= self.lease and not holder.gone():
                return holder
            try:  # a lease its holder stopped renewing: taken over, unless another process was first
                self.etag = self.store.write_if(LOCK_KEY, self.holder.encode(), etag)
            except Contended:
                continue
            log.warning("took over the lease of the run at %s from %s (%s)", self.store.uri, holder.describe(),
                        "its process is gone" if holder.gone() else f"not renewed for {age:.0f} s")
            break
        self._renewer = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._renewer.start()
        return None

    def _renew(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.lease / 3):
            self.holder = Holder(**{**asdict(self.holder), "renewals": self.holder.renewals + 1})
            try:
                self.etag = self.store.write_if(LOCK_KEY, self.holder.encode(), self.etag)
                renewed = time.monotonic()
            except Contended:
                self.lost = "another process took the run's lease over"
            except StorageError as e:
                log.warning("could not renew the lease of the run at %s: %s", self.store.uri, e)
                if time.monotonic() - renewed > self.lease:
                    self.lost = f"its lease could not be renewed for {self.lease:.0f} s ({e})"
            if self.lost:
                log.error("the run at %s is no longer this process's: %s", self.store.uri, self.lost)
                return

    def check(self) -> None:
        if self.lost:
            raise RunLockLost(f"the run at {self.store.uri} is no longer this process's: {self.lost}; it stops "
                              "rather than write beside another (`lsreplay resume` continues it)")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.lost or self.etag is None:
            return
        try:
            self.store.delete_if(LOCK_KEY, self.etag)
        except StorageError as e:  # taken over meanwhile, or unreachable: it expires
            log.warning("could not release the lease of the run at %s: %s", self.store.uri, e)
