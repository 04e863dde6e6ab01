"""One writer per run: the lock a process holds for as long as it runs a run.

Two processes on one run would undo each other: the second's sweep deletes the first's
temporary files and aborts its uploads, its rewind deletes the first's policy markers, and
lines of metrics.jsonl are lost between their read-modify-writes. So `lsreplay train`,
`resume` and every flow run hold the run's lock, `run.lock` at the root of its store:

- a local store: an advisory lock (flock) on that file, which dies with its process; the
  file names the holder (host, pid, since) for the message a second process gets.
- S3: a lease, the object itself, created with a conditional PUT (If-None-Match: *) and
  renewed every LEASE_SECONDS / 3 with a PUT on its ETag (If-Match), by a process of its own
  (lsreplay.core.lease_renewer: nothing this process computes delays a renewal). A holder
  that stops renewing loses it LEASE_SECONDS after its last renewal, by the server's clock,
  whether its process is gone or stalled, on this host or another (a process of another
  container may share this host's name: only the heartbeat tells). Another process then
  takes it over with a PUT on the ETag it read. Released with a conditional DELETE.

A lease fences this process's writes to the run's store (every thread's: the background
checkpoint writer's too, lsreplay.core.storage.fence): a write starts only before the last
renewal + LEASE_SECONDS - MARGIN, measured on this machine's monotonic clock from when that
renewal's request left, so it starts before anyone could take the lease over; a commit
write (a done marker, a checkpoint's record, the run's config and metrics) renews the lease
first and is refused if that renewal is (RunLockLost).

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
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from lsreplay.core import storage
from lsreplay.core.config import ConfigError
from lsreplay.core.storage import StorageError, Store

log = logging.getLogger(__name__)

LOCK_KEY = "run.lock"
# An S3 lease's life without renewal; the environment sets it (tests make it short).
LEASE_ENV, LEASE_SECONDS = "LSREPLAY_RUN_LEASE_SECONDS", 60.0
# The part of its life before its end at which a holder stops writing: time for a write that
# started to finish before anyone may take the lease over.
MARGIN = 0.25
# How long the renewer process may take to start and answer the first request.
RENEWER_START_SECONDS = 120.0
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
                            f"Wait for it to end (--wait waits for it), or stop it first{lock.hint()}")
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

    def hint(self) -> str:
        """What a process refused the lock may want to know besides its holder."""
        return ""

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


def lease_clock() -> float:
    """Seconds on this machine's monotonic clock that also counts time suspended (Linux's
    CLOCK_BOOTTIME): a lease's life passes on the server while the machine sleeps."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class _Lease(_Lock):
    """The run's lease in an object store, held by a renewer process (see the module's docstring)."""

    def __init__(self, store: Store):
        self.store = store
        self.lease = float(os.environ.get(LEASE_ENV, LEASE_SECONDS))
        self.margin = self.lease * MARGIN
        self.holder = Holder.me()
        self.renewed: float | None = None  # when the newest renewal (or the taking) left, on lease_clock
        self.lost: str | None = None
        self._held_age: float | None = None  # of another's lease, as the last try found it
        self._renewer: subprocess.Popen | None = None
        self._pending = b""
        self._asked = 0
        self._io = threading.Lock()  # the writers of every thread fence through it

    def try_acquire(self) -> Holder | None:
        with self._io:
            answer = self._ask({"acquire": asdict(self.holder)}, RENEWER_START_SECONDS)
        self._held_age = answer.get("age")
        if "held" in answer:
            return Holder.parse(answer["held"].encode()) or Holder("(a writer not of lsreplay)", 0, "?", "")
        if "acquired" not in answer:
            raise StorageError(f"could not take the lease of the run at {self.store.uri}: {answer.get('failed')}")
        if answer.get("took_over"):
            log.warning("took over the lease of the run at %s from %s", self.store.uri, answer["took_over"])
        self.renewed = answer["acquired"]
        storage.fence(self.store.uri, self.fence)
        return None

    def hint(self) -> str:
        return (f". Its lease was renewed {self._held_age:.0f} s ago; one its holder stops renewing (a process that "
                f"was killed) is taken over {self.lease:.0f} s after its last renewal, which --wait waits for"
                if self._held_age is not None else "")

    def fence(self, commit: bool) -> None:
        """RunLockLost unless this process may write to the run's store now; a `commit` write
        renews the lease first (its renewal refused: RunLockLost)."""
        with self._io:
            if commit and not self.lost:
                answer = self._ask({"renew": True}, max(0.0, self._deadline() - lease_clock()))
                if "renewed" in answer:
                    self.renewed = answer["renewed"]
                else:
                    self.lost = self.lost or f"its renewal before a commit failed ({answer.get('failed')})"
            else:
                self._drain(0.0)
            self._raise_if_lost()

    def check(self) -> None:
        with self._io:
            self._drain(0.0)
            self._raise_if_lost()

    def _deadline(self) -> float:
        return self.renewed + self.lease - self.margin

    def _raise_if_lost(self) -> None:
        if not self.lost and lease_clock() > self._deadline():
            self.lost = (f"its lease was not renewed for {self.lease - self.margin:.0f} s (its life, "
                         f"{self.lease:.0f} s, less a margin): another process may take it over")
        if self.lost:
            raise RunLockLost(f"the run at {self.store.uri} is no longer this process's: {self.lost}; it stops "
                              "rather than write beside another (`lsreplay resume` continues it)")

    def _ask(self, request: dict, seconds: float) -> dict:
        """The renewer's answer to `request` (started if need be), read within `seconds`; its
        other messages on the way are taken in. {"failed": ...} if none comes in time."""
        if self._renewer is None:
            self._renewer = subprocess.Popen([sys.executable, "-m", "lsreplay.core.lease_renewer"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
            self._send({"uri": self.store.uri, "options": self.store.options, "lease": self.lease})
        self._asked += 1
        self._send({**request, "id": self._asked})
        return self._drain(seconds, self._asked) or {"failed": f"no answer from the lease's renewer in {seconds:.0f} s"}

    def _send(self, message: dict) -> None:
        try:
            self._renewer.stdin.write(json.dumps(message).encode() + b"\n")
            self._renewer.stdin.flush()
        except OSError:  # it ended: its messages say why, or its status does
            pass

    def _drain(self, seconds: float, reply: int | None = None) -> dict | None:
        """Take in the renewer's messages that arrive within `seconds` (0: those there now), up
        to the answer to request `reply`, which is returned."""
        end = lease_clock() + seconds
        while self._renewer is not None:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                self._take(message)
                if reply is not None and message.get("reply") == reply:
                    return message
            if not select.select([self._renewer.stdout], [], [], max(0.0, end - lease_clock()))[0]:
                return None
            chunk = os.read(self._renewer.stdout.fileno(), 1 << 16)
            if not chunk:
                self.lost = self.lost or f"its lease's renewer ended (status {self._renewer.wait()})"
                return None
            self._pending += chunk
        return None

    def _take(self, message: dict) -> None:
        if "renewed" in message:
            self.renewed = message["renewed"]
        elif "lost" in message and self.renewed is not None:
            self.lost = self.lost or message["lost"]
            log.error("the run at %s is no longer this process's: %s", self.store.uri, message["lost"])
        elif "failed" in message and "reply" not in message:  # a renewal of its own (an answer is the asker's)
            log.warning("could not renew the lease of the run at %s: %s", self.store.uri, message["failed"])

    def release(self) -> None:
        storage.fence(self.store.uri, None)
        with self._io:
            if self._renewer is None:
                return
            if not self.lost:
                answer = self._ask({"release": True}, self.lease)
                if "failed" in answer:  # taken over meanwhile, or unreachable: it runs out
                    log.warning("could not release the lease of the run at %s: %s", self.store.uri,
                                answer["failed"])
            self._renewer.stdin.close()  # the renewer ends (without releasing what it may still hold)
            try:
                self._renewer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._renewer.kill()
                self._renewer.wait()
            self._renewer = None
