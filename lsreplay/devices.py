"""Which accelerator indices a holder of pool slots owns: one lock file per device.

The Prefect pool (a global concurrency limit) bounds how many slots are held; it does
not say which device a holder got. A holder therefore takes free per-device locks.
fcntl locks die with their process, so a crashed task never strands a device.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def hold_devices(pool: str, slots: int, count: int, lock_dir: str | Path = ".cache/pool"):
    """Yield `count` device indices in [0, slots), exclusively held until the block exits."""
    folder = Path(lock_dir) / pool
    folder.mkdir(parents=True, exist_ok=True)
    held: list[tuple[int, int]] = []
    try:
        for index in range(slots):
            if len(held) == count:
                break
            fd = os.open(folder / f"{index}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append((index, fd))
            except BlockingIOError:
                os.close(fd)
        if len(held) < count:
            raise RuntimeError(f"pool {pool!r}: wanted {count} free devices of {slots}, found {len(held)}; "
                               "another process holds device locks outside the pool's concurrency limit")
        yield [index for index, _ in held]
    finally:
        for _, fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

