"""Which accelerator indices a holder of pool slots owns: one lock file per device.

The Prefect pool (a global concurrency limit) bounds how many slots are held; it does
not say which device a holder got. A holder therefore takes free per-device locks.
fcntl locks die with their process, so a crashed task never strands a device.
"""

from __future__ import annotations

import contextvars
import fcntl
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


LOCK_DIR = ".cache/pool"


@contextmanager
def hold_devices(pool: str, slots: int, count: int, lock_dir: str | Path = LOCK_DIR):
    """Yield `count` device indices in [0, slots), exclusively held until the block exits."""
    held: list[tuple[int, int]] = []
    try:
        for index in range(slots):
            if len(held) == count:
                break
            if (fd := _try_lock(Path(lock_dir) / pool, index)) is not None:
                held.append((index, fd))
        if len(held) < count:
            raise RuntimeError(f"pool {pool!r}: wanted {count} free devices of {slots}, found {len(held)}; "
                               "another process holds device locks outside the pool's concurrency limit")
        yield [index for index, _ in held]
    finally:
        for _, fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)



def any_held(pool: str, slots: int, lock_dir: str | Path = LOCK_DIR) -> bool:
    """Whether a live process on this machine holds one of the pool's devices."""
    for index in range(slots):
        if (fd := _try_lock(Path(lock_dir) / pool, index)) is None:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return False


def _try_lock(folder: Path, index: int) -> int | None:
    """The open, exclusively locked lock file of device `index`, or None if another holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{index}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def on_idle_cpu(fn: Callable[[], T]) -> T:
    """fn() run on a new thread under Linux's SCHED_IDLE policy; its result or error.

    On a CPU pool, work that is meant to fill idle time (the spot drafter) shares the cores
    with the rollouts; under SCHED_IDLE it runs only when no normal thread wants the core,
    and a waking normal thread preempts it at once (nice 19 still took ~50% off the
    rollouts' speed: their many short ops each waited for the scheduler to switch back).
    Linux keeps the policy per thread, and the OpenMP threads torch starts for this thread
    inherit it. A new thread, because an unprivileged process may not leave SCHED_IDLE."""
    out: dict = {}

    def target() -> None:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    context = contextvars.copy_context()  # the caller's run context (Prefect's logging reads it)
    worker = threading.Thread(target=context.run, args=(target,), name="idle-cpu")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
