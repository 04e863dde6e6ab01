"""The vLLM engine's process: forked from a fork server that has imported vLLM once.

An engine process spends most of a start importing (torch, vLLM's compiler stack,
transformers: 8 s of a CPU core) before vLLM builds the engine (2.4 s for a tiny model on
CPU). A fork server is a process of vLLM's Python that has done those imports
(lsreplay/rollout/vllm_worker.py --fork-server); every engine of the same environment is
forked from it, so an engine started again (a retry after a failure, the first with a
drafter, a resume) skips them. vLLM forks its own workers at the same point (after its
imports, before CUDA or OpenMP start); every vLLM test's engine is a forked one, and
tests/test_vllm_engine.py checks the fork server's own failures.

The environment is the fork server's: OpenMP reads its settings as it loads, so engines
whose environments differ (threads, devices) get a fork server each. A fork server ends
with the process that started it (its connection closes); the engines it forked end with
their own connections.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from pathlib import Path

WORKER = Path(__file__).with_name("vllm_worker.py")
AUTHKEY_ENV = "LSREPLAY_VLLM_AUTHKEY"
# An exit code for an engine whose fork server ended before it could say (init reaped it).
UNKNOWN_EXIT = -1


class EngineProcessError(RuntimeError):
    """The engine process (or its fork server) did not start; the message says what its log shows."""


class EngineProcess:
    """A forked engine process, with what the engine uses of Popen's: pid, poll, wait, kill,
    returncode. Watched through a pidfd, so that a signal never reaches a recycled pid."""

    def __init__(self, server: ForkServer, pid: int):
        self.pid, self.returncode, self._server = pid, None, server
        self._pidfd = os.pidfd_open(pid)
        self._lock = threading.Lock()  # reaped once, whichever thread sees the end first; no signal after

    def poll(self) -> int | None:
        """The exit code if the process has ended, else None."""
        with self._lock:
            if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
                self.returncode = self._server.reap(self.pid)
                os.close(self._pidfd)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the process has ended; subprocess.TimeoutExpired after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left < 0:
                raise subprocess.TimeoutExpired(str(WORKER), timeout)
            with self._lock:  # the pidfd is closed only under it, once the process is reaped
                if self.returncode is None:
                    select.select([self._pidfd], [], [], left)
        return code

    def kill(self) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):  # reaped by init (its server gone): as Popen's
            if self.returncode is None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def connected(start: Callable[[str, bytes], subprocess.Popen | EngineProcess], timeout: float):
    """(the connection, the process) of a process `start(address, authkey)` starts, once it
    connects to `address` with `authkey`; (None, the process, killed) if it ended or
    `timeout` s passed first."""
    folder = tempfile.mkdtemp(prefix="lsreplay-vllm-")
    address, authkey = os.path.join(folder, "socket"), secrets.token_hex(16).encode()
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    try:
        process = start(address, authkey)
        accepted: list = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        deadline = time.monotonic() + timeout
        while waiter.is_alive() and process.poll() is None and time.monotonic() < deadline:
            waiter.join(0.2)
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)  # the connection, once made, needs no socket file
    if not accepted:
        process.kill()
        process.wait()
        return None, process
    return accepted[0], process


class ForkServer:
    """A process of vLLM's Python (`python`) that has imported vLLM, in `environment`; it
    forks engine processes. One request at a time (engines start from several threads)."""

    def __init__(self, python: str, environment: dict[str, str], timeout: float):
        descriptor, log = tempfile.mkstemp(prefix="lsreplay-vllm-fork-server-", suffix=".log")
        os.close(descriptor)
        self.timeout, self._lock = timeout, threading.Lock()

        def start(address: str, authkey: bytes) -> subprocess.Popen:
            with open(log, "ab") as out:
                return subprocess.Popen([python, "-P", str(WORKER), "--fork-server", address],
                                        env={**environment, AUTHKEY_ENV: authkey.decode()}, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        self._conn, self._process = connected(start, timeout)
        if self._conn is None:
            raise EngineProcessError(f"the vLLM fork server did not start ({log_tail(Path(log))}); check that "
                                     f"{python} can `import vllm`")
        Path(log).unlink()  # its imports went well: it prints nothing more

    def alive(self) -> bool:
        return self._process.poll() is None  # close() ends the process too

    def fork(self, address: str, authkey: bytes, log: Path) -> EngineProcess:
        """An engine process that connects to `address` with `authkey`, its output to `log`."""
        return EngineProcess(self, self._ask(op="fork", address=address, authkey=authkey, log=str(log))["pid"])

    def reap(self, pid: int) -> int:
        """The exit code of the ended engine `pid` (UNKNOWN_EXIT if this server ended before it)."""
        try:
            return self._ask(op="reap", pid=pid)["returncode"]
        except EngineProcessError:
            return UNKNOWN_EXIT

    def _ask(self, **request) -> dict:
        with self._lock:
            try:
                self._conn.send(request)
                if self._conn.poll(self.timeout):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            self.close()
            raise EngineProcessError(f"the vLLM fork server did not answer {request['op']!r} (exit code "
                                     f"{self._process.returncode}); a new one starts with the next engine")

    def close(self) -> None:
        """End the server (the engines it forked go on)."""
        self._conn.close()
        self._process.kill()
        self._process.wait()


_SERVERS: dict[tuple, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def fork_engine(python: str, environment: dict[str, str], log: Path, timeout: float) -> tuple[Connection,
                                                                                                EngineProcess]:
    """(the connection, the process) of a new engine process in `environment`, forked from
    the fork server of that environment, its output to `log`; EngineProcessError saying why
    if it did not start within `timeout` s."""
    key = (python, tuple(sorted(environment.items())))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive():  # started on first use, and again if it ended
            if server is not None:
                server.close()
            server = _SERVERS[key] = ForkServer(python, environment, timeout)
    conn, process = connected(lambda address, authkey: server.fork(address, authkey, log), timeout)
    if conn is None:
        raise EngineProcessError(f"the vLLM engine process did not start ({log_tail(log)})")
    return conn, process


def close_fork_servers() -> None:
    """End every fork server: the next engine starts one again, as a first engine does."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


def log_tail(log: Path, lines: int = 12) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    tail = [line for line in text if "WARNING: Location" not in line][-lines:]
    return "its log ends: " + " | ".join(tail) if tail else "it wrote no log"
