"""Computation on what others wrote, in a child process this one can stop.

A thread given a timeout cannot be stopped, and while it computes in the interpreter (one
`**` on huge integers, a sympy simplification) it holds the GIL: the timeout's own wait, the
run's other stages and every renewal on a thread of this process wait with it. So a call on
model text or code the user marked untrusted runs in a `Child`: a Python process of its own
(`python -m lsreplay.core.sandbox`) that

- has an address space of `memory_bytes` (RLIMIT_AS: a bigger allocation fails with
  MemoryError) and `cpu_seconds` of CPU per call (RLIMIT_CPU: the kernel stops it past them);
- is killed by this process when a call passes its wall `seconds` (Overrun), and started
  again for the next call;
- gets no credential of this process's environment (a variable whose name says it holds one)
  and no open file of it;
- answers in JSON only, read with json.loads: what it sends back is data, never unpickled,
  whatever ran in it.

The child calls `module:function` names this process gives (lsreplay's own entry points, such
as lsreplay.data.hardened_checkers.score_in_child), with JSON arguments; its preparations
(imports, functions loaded) run at each start, outside any call's time. Calls to one Child are
one at a time (a lock); `child(name, limits)` gives this process's Child of that name and
limits.
"""

from __future__ import annotations

import atexit
import importlib
import json
import math
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from lsreplay.core.config import SECRET_NAME, SandboxConfig

# The most bytes one answer may hold: a child cannot make this process allocate more.
MAX_REPLY_BYTES = 64 * 2**20
# Seconds a child may take to start: the interpreter, its imports, each of its preparations.
START_SECONDS = 300.0


class SandboxError(RuntimeError):
    """A call that failed in the child (the message names its exception), or a child that died."""


class Overdue(TimeoutError):
    """A call given a deadline did not return by then (not a TimeoutError of its own)."""


class Overrun(Overdue):
    """A call in a child that passed its wall time: the child was killed."""


@dataclass(frozen=True)
class Limits:
    cpu_seconds: float  # CPU time of one call
    memory_bytes: int  # the child's address space


def limits_of(sandbox: SandboxConfig) -> Limits:
    """The limits sandbox.* gives a child."""
    return Limits(sandbox.cpu_seconds, sandbox.memory_mb * 2**20)


class Child:
    """One child process that calls functions by name (see the module's docstring)."""

    def __init__(self, name: str, limits: Limits):
        self.name, self.limits = name, limits
        self._process: subprocess.Popen | None = None
        # Calls made after every start, within START_SECONDS (imports, functions loaded), so
        # that a call's wall time is the call's alone.
        self._preparations: list[tuple[str, list]] = []
        self._lock = threading.Lock()
        self.starts = 0  # processes started: one more after each kill

    def prepare(self, function: str, *args) -> None:
        """Make `function(*args)` part of every start of the child, and run it now (starting
        the child if need be); SandboxError if it fails (then it is not kept)."""
        with self._lock:
            if (function, list(args)) in self._preparations:
                self._running()
                return
            self._preparations.append((function, list(args)))
            try:
                if self._process is not None and self._process.poll() is None:
                    self._request(self._process, function, list(args), {}, START_SECONDS)
                else:
                    self._running()
            except BaseException:
                self._preparations.remove((function, list(args)))
                raise

    def start(self) -> None:
        """Start the child and run its preparations, unless it runs: a caller timing a call
        starts its clock after this."""
        with self._lock:
            self._running()

    def call(self, function: str, *args, seconds: float = 0.0, **kwargs):
        """`function(*args, **kwargs)` in the child ("module:name"); its JSON value. Overrun
        past `seconds` of wall time (0: no limit), and the child is killed; SandboxError if
        the call raised or the child died."""
        with self._lock:
            return self._request(self._running(), function, list(args), kwargs, seconds)

    def _running(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "lsreplay.core.sandbox", str(self.limits.memory_bytes)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=_environment(), close_fds=True)
            self.starts += 1
            try:
                for function, args in self._preparations:
                    self._request(self._process, function, args, {}, START_SECONDS)
            except BaseException:  # not prepared: never used
                if self._process is not None:
                    self._kill(self._process)
                raise
        return self._process

    def _request(self, process: subprocess.Popen, function: str, args: list, kwargs: dict, seconds: float):
        request = json.dumps({"function": function, "args": args, "kwargs": kwargs,
                              "cpu_seconds": self.limits.cpu_seconds}).encode() + b"\n"
        try:
            process.stdin.write(request)
            process.stdin.flush()
        except OSError:  # it died since its last answer
            raise SandboxError(self._ended(process)) from None
        reply = self._reply(process, time.monotonic() + seconds if seconds else math.inf, function, seconds)
        if "error" in reply:
            raise SandboxError(f"{function} raised {reply['error']} in the {self.name} child process")
        return reply["value"]

    def _reply(self, process: subprocess.Popen, deadline: float, function: str, seconds: float) -> dict:
        """The child's next line, read by the deadline: Overrun (the child killed) past it."""
        data = bytearray()
        with selectors.DefaultSelector() as waiting:
            waiting.register(process.stdout, selectors.EVENT_READ)
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not waiting.select(min(left, 3600)):
                    if time.monotonic() < deadline:
                        continue
                    self._kill(process)
                    raise Overrun(f"{function} did not return within {seconds:g} s in the {self.name} child process "
                                  "(killed)")
                chunk = os.read(process.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise SandboxError(self._ended(process))
                data += chunk
                if len(data) > MAX_REPLY_BYTES:
                    self._kill(process)
                    raise SandboxError(f"{function} answered more than {MAX_REPLY_BYTES} bytes in the {self.name} "
                                       "child process (killed)")
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not ("value" in reply or "error" in reply):
            self._kill(process)
            raise SandboxError(f"the {self.name} child process answered {bytes(data[:80])!r}, not a reply (killed)")
        return reply

    def _ended(self, process: subprocess.Popen) -> str:
        code = process.wait()
        self._process = None
        why = {-signal.SIGXCPU: f"used up its {self.limits.cpu_seconds:g} CPU seconds",
               -signal.SIGKILL: "was killed"}.get(code, f"ended with status {code}")
        return f"the {self.name} child process {why}"

    def _kill(self, process: subprocess.Popen) -> None:
        process.kill()
        process.wait()
        self._process = None

    def close(self) -> None:
        """Stop the child and forget its preparations: a later start is a fresh child, which
        each caller prepares again (one run's tools must not be loaded at another's start)."""
        with self._lock:
            self._preparations.clear()
            if self._process is not None:
                self._kill(self._process)


def _environment() -> dict[str, str]:
    """This process's environment less every variable whose name says it holds a credential."""
    return {k: v for k, v in os.environ.items() if not SECRET_NAME.search(k)}


_CHILDREN: dict[tuple, Child] = {}
_CHILDREN_LOCK = threading.Lock()


def child(name: str, limits: Limits) -> Child:
    """This process's Child `name` with `limits` (started at its first call, stopped at exit)."""
    with _CHILDREN_LOCK:
        if (name, limits) not in _CHILDREN:
            _CHILDREN[(name, limits)] = Child(name, limits)
        return _CHILDREN[(name, limits)]


@atexit.register
def close_children() -> None:
    """Stop every child of this process and forget what they loaded (each starts again, as
    its next caller prepares it)."""
    with _CHILDREN_LOCK:
        children = list(_CHILDREN.values())
    for found in children:
        found.close()


# -- the child's side ------------------------------------------------------------------------
def _serve(memory_bytes: int) -> None:
    """Answer requests, one JSON line each on stdin, with one JSON line each on the original
    stdout; what the functions print goes to stderr."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a child stopped past its CPU time leaves no core file
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    functions: dict = {}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _limit_cpu(request["cpu_seconds"])
        try:
            if request["function"] not in functions:
                module, _, name = request["function"].partition(":")
                functions[request["function"]] = getattr(importlib.import_module(module), name)
            reply = json.dumps({"value": functions[request["function"]](*request["args"], **request["kwargs"])})
        except BaseException as e:  # every failure is an answer; the parent decides
            reply = json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]})
        replies.write(reply.encode() + b"\n")
        replies.flush()


def _limit_cpu(seconds: float) -> None:
    """SIGXCPU once this call has used `seconds` of CPU more than the process had."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft, hard = math.ceil(usage.ru_utime + usage.ru_stime + seconds), resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
