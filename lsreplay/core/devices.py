"""Which devices a holder of pool slots owns, and the torch device each stands for.

The Prefect pool (a global concurrency limit) bounds how many slots are held; it does
not say which device a holder got. A holder therefore takes free per-device locks: one
lock file per device in a folder of this user's, so that two runs of the user on one
machine (from any folder, on any pool name) never compute on the same GPU. A GPU's lock is
named by its UUID, which CUDA_VISIBLE_DEVICES does not renumber. fcntl locks die with their
process, so a crashed task never strands a device. Only the user can write the folder: a
lock file another user created could be held by them for good, and a link planted there
would make opening it create a file elsewhere.
"""

from __future__ import annotations

import contextvars
import fcntl
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from lsreplay.core.config import ConfigError, PoolConfig

T = TypeVar("T")
log = logging.getLogger(__name__)

LOCK_DIR_ENV = "LSREPLAY_LOCK_DIR"
# How often a holder looks again for a device another run holds.
POLL_SECONDS = 1.0


class DeviceWaitTimeout(TimeoutError):
    """A stage waited pool.wait_seconds for devices another holder kept."""


def lock_dir() -> Path:
    """Per user, machine-wide (not per working directory); LSREPLAY_LOCK_DIR overrides it."""
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / f"lsreplay-devices-{os.getuid()}")


def _own_lock_dir() -> Path:
    """lock_dir(), made if missing, checked to be this user's alone (ConfigError otherwise)."""
    folder = lock_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ConfigError(f"the device lock folder {folder} is not this user's alone (owner uid {info.st_uid}, mode "
                          f"{stat.filemode(info.st_mode)}): another user could create or hold its lock files. Remove "
                          f"it (it is made again, only yours), or set {LOCK_DIR_ENV} to a folder only you can write")
    return folder


# Pool indices a host process (lsreplay.distributed.hosts) serves on devices of its own numbering: a
# Ray actor sees only the GPUs Ray gave it, as cuda:0, cuda:1, ...
_PINNED: dict[int, torch.device] = {}


def pin(indices: list[int], devices: list[torch.device]) -> None:
    """This process computes pool slots `indices` on `devices`."""
    _PINNED.update(zip(indices, devices))


def torch_device(pool: PoolConfig, index: int | None) -> torch.device:
    """The device pool slot `index` computes on: the one this process pinned it to, else
    cuda:<index> on a GPU pool, else the CPU."""
    if index in _PINNED:
        return _PINNED[index]
    if pool.accelerator == "cuda" and index is not None:
        return torch.device("cuda", index)
    return torch.device("cpu")


# cuBLAS's reductions are deterministic with a fixed workspace (torch refuses deterministic
# matmuls without one): 8 buffers of 4 MiB.
CUBLAS_WORKSPACE = ":4096:8"


def cuda_determinism(pool: PoolConfig) -> None:
    """How this process computes on a GPU pool (docs/gpu.md: what a resume guarantees):
    deterministic cuBLAS always; with pool.deterministic, every op deterministic (flash
    attention's and gather's backwards without atomics) or an error naming the op. Without torch's debugging fill of every new tensor, which would
    write each output twice. Process-wide; set before the first CUDA work of a stage, since
    cuBLAS reads its workspace setting when it starts."""
    if pool.accelerator != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(pool.deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False


def check_accelerator(pool: PoolConfig, devices: int | None = None) -> None:
    """A GPU pool on a process that sees too few GPUs is an error before any work: the
    flow's process under the thread runner needs every slot's (`devices` None); a Ray host
    (lsreplay.distributed.hosts) the `devices` Ray gave it."""
    if pool.accelerator != "cuda":
        return
    where = "this process" if devices is None else f"this Ray host of {devices} pool device(s)"
    if not torch.cuda.is_available():
        raise ConfigError(f"pool.accelerator=cuda, but {where} sees no CUDA device (torch {torch.__version__}, "
                          f"CUDA build: {torch.version.cuda or 'no'}); run on a GPU machine, or use pool.accelerator=cpu")
    if devices is None and torch.cuda.device_count() < pool.slots:
        raise ConfigError(f"pool.slots={pool.slots} GPUs wanted, but this process sees {torch.cuda.device_count()}; "
                          "lower pool.slots or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if devices is not None and torch.cuda.device_count() < devices:
        raise ConfigError(f"{where} sees {torch.cuda.device_count()} GPU(s) with pool.ray_gpus={pool.ray_gpus}; "
                          "give every pool device a GPU of its own: pool.ray_gpus=1")


def _lock_name(pool: PoolConfig, index: int) -> str:
    """A GPU's UUID under the thread runner, where this process computes on it. Under Ray the
    flow's process computes on no GPU (and may see none): Ray gives each host its GPUs, so
    the lock stands for the pool slot only."""
    if pool.accelerator == "cuda" and pool.task_runner == "thread":
        return f"cuda-{torch.cuda.get_device_properties(index).uuid}"
    return f"{pool.name}-{index}"


@contextmanager
def hold_devices(pool: PoolConfig, count: int, on: list[int] | None = None):
    """Yield `count` device indices in [0, pool.slots), or exactly those of `on`, exclusively
    held until the block exits. Waits (and says so once) while another holder has them, up to
    pool.wait_seconds (then DeviceWaitTimeout)."""
    held: dict[int, int] = {}  # device index -> lock fd
    waiting_since = None
    try:
        while True:
            for index in on if on is not None else range(pool.slots):
                if len(held) < count and index not in held:
                    if (fd := _try_lock(_lock_name(pool, index))) is not None:
                        held[index] = fd
            if len(held) == count:
                break
            wanted = f"devices {on}, whose host holds this stage's state" if on is not None else \
                "devices another run on this machine holds"
            if waiting_since is None:
                waiting_since = time.monotonic()
                log.warning("pool %r: %d of %d devices free; waiting for %s", pool.name, len(held), count, wanted)
            elif pool.wait_seconds and time.monotonic() - waiting_since > pool.wait_seconds:
                raise DeviceWaitTimeout(f"pool {pool.name!r}: waited pool.wait_seconds={pool.wait_seconds:g} for "
                                        f"{wanted} (lock files in {lock_dir()}); stop the run that holds them, or "
                                        "raise pool.wait_seconds")
            time.sleep(POLL_SECONDS)
        yield list(held)
    finally:
        for fd in held.values():
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def any_held(pool: PoolConfig, slots: int) -> bool:
    """Whether a live process on this machine holds one of the pool's first `slots` devices."""
    if pool.accelerator == "cuda" and pool.task_runner == "thread":
        slots = min(slots, torch.cuda.device_count())
    for index in range(slots):
        if (fd := _try_lock(_lock_name(pool, index))) is None:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return False


def _try_lock(name: str) -> int | None:
    """The open, exclusively locked lock file `name`, or None if another process holds it."""
    fd = os.open(_own_lock_dir() / f"{name}.lock", os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


# The errors SCHED_IDLE was refused with in this process, each said once.
_IDLE_REFUSED: set[str] = set()


def idle_priority() -> bool:
    """Put the calling thread (and the OpenMP threads it starts) under Linux's SCHED_IDLE: it
    runs only when no normal thread wants the core. For good: an unprivileged thread may not
    leave SCHED_IDLE. Returns whether it did: where the kernel refuses (some sandboxes,
    gVisor among them, answer EINVAL) the thread goes on at normal priority, said once, since
    the work must still be done."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError as e:
        if (reason := f"{type(e).__name__}: {e}") not in _IDLE_REFUSED:
            _IDLE_REFUSED.add(reason)
            log.warning("this kernel refuses the idle scheduling policy (%s): the drafter on a CPU pool runs "
                        "at normal priority", reason)
        return False


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
            idle_priority()
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
