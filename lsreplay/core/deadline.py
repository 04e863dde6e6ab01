"""pool.stage_timeout_seconds: a stage try that runs past it ends this process.

Nothing can stop a thread from outside while it is blocked in C (a socket read, a collective,
a kernel, a library call): Python delivers an interruption between bytecodes only, and a try
interrupted late may still be running, and writing into the run, beside its retry. So when a
try computing in this process passes its deadline, a watchdog logs which stage and step, how
to resume, and the stage's stack (where it was blocked), asks the processes this one started
to end (a vLLM engine, a sandbox, Prefect's temporary server), then ends the process as a crash
would: nothing of the try runs on. The run's store holds everything committed before, so
`lsreplay resume` continues it as after any crash, recomputing the stage. (Under
pool.task_runner=ray the flow bounds each stage where it waits for the stage's Ray host and
ends that host instead: lsreplay.distributed.hosts.run_on_host.)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lsreplay.core.config import Config

log = logging.getLogger(__name__)

# The exit status of a process ended by a stage's deadline (as coreutils' `timeout` exits).
TIMED_OUT_EXIT = 124
# The most seconds the watchdog spends reporting (the log's handlers may send to an API that
# is itself what blocks) before it ends the process anyway.
REPORT_SECONDS = 10.0


@contextmanager
def stage_deadline(cfg: Config, stage: str, step: int) -> Iterator[None]:
    """The block is one try of `stage` of `step`; past pool.stage_timeout_seconds (0: never)
    the process ends with TIMED_OUT_EXIT."""
    seconds = cfg.pool.stage_timeout_seconds
    if not seconds:
        yield
        return
    watchdog = threading.Timer(seconds, _end_process, args=(cfg, stage, step, seconds, threading.get_ident()))
    watchdog.daemon = True
    watchdog.name = f"deadline {stage} step {step}"
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _end_process(cfg: Config, stage: str, step: int, seconds: float, thread: int) -> None:
    reporter = threading.Thread(target=_report, args=(cfg, stage, step, seconds, thread), daemon=True)
    reporter.start()
    reporter.join(REPORT_SECONDS)
    for pid in _children():
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    os._exit(TIMED_OUT_EXIT)


def _children() -> list[int]:
    """The processes this one started that still run (from Linux's /proc; elsewhere none are known)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):  # ended meanwhile
            fields = stat.read_text().rpartition(")")[2].split()  # after the command's name, which may hold spaces
            if int(fields[1]) == os.getpid():
                children.append(int(stat.parent.name))
    return children


def _report(cfg: Config, stage: str, step: int, seconds: float, thread: int) -> None:
    frame = sys._current_frames().get(thread)  # readable while the thread is blocked in C
    uri = cfg.storage.uri or cfg.run_dir
    # An S3 run's lease outlives this process by its life (lsreplay.core.run_lock): --wait waits it out.
    resume = f"lsreplay resume {uri}" + (" --wait" if uri.startswith("s3://") else "")
    where = "".join(traceback.format_stack(frame)) if frame is not None else "  (the stage's thread has ended)\n"
    log.error("stage %s of step %d ran past pool.stage_timeout_seconds=%g: ending this process, since a stage "
              "blocked in C or on a socket cannot be stopped otherwise. Everything committed before is kept; "
              "continue the run with: %s (raise pool.stage_timeout_seconds if the stage is only slow). Where the "
              "stage was, most recent call last:\n%s", stage, step, seconds, resume, where.rstrip("\n"))
    for handler in logging.getLogger().handlers:
        handler.flush()
