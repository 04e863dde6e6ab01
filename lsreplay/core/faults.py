"""Fault injection for testing resume, retries and failure handling.

Faults come from the environment variable LSREPLAY_FAULTS, a comma-separated list of

    STAGE[@STEP]:kill        SIGKILL this process in the middle of the stage (after it has
                             written some of its outputs, before its done marker)
    STAGE[@STEP]:fail[*N]    raise a transient InjectedFault when the stage starts, N times
                             (default 1); Prefect's task retries then run it again
    STAGE[@STEP]:error       raise a permanent InjectedError when the stage starts
    STAGE[@STEP]:stall[*N]   hold the stage at its middle for LSREPLAY_STALL_SECONDS (default
                             5), N times (default 1): a straggler, e.g. one slow rollout shard.
                             One blocking call, or with LSREPLAY_STALL_UNTIL=PATH until that
                             file exists (a test that ends the stall once it saw what it waits for)
    trees[@STEP]:kill_engine SIGKILL the vLLM engine (rollout.engine=vllm) in the middle of the
                             stage's call to it, once: the shard fails, its retry starts a new engine
    policy[@STEP]:nan        make the policy loss NaN (the step must not be committed)
    policy[@STEP]:kill_rank  SIGKILL the last rank of a data-parallel update (pool.devices_per_step
                             > 1) as its backward starts, once: the ranks waiting on it fail, and
                             the stage's try with them
    policy[@STEP]:interrupt  raise a transient InjectedFault right after the optimizer step,
                             before the update is recorded (a stage timeout may strike there)
    checkpoint[@STEP]:tear   SIGKILL this process halfway through writing the weights file of
                             the step's policy checkpoint: a torn write (a partial temporary
                             file beside a local store's entry, an incomplete S3 multipart upload)
    checkpoint[@STEP]:full   every write of the step's policy checkpoint fails as on a full
                             disk (OSError ENOSPC): the background writer's failure
    storage:fail[*N]         the next N store writes raise a transient ConnectionError
    ranks:fail[*N]           the next N launches of ranks (lsreplay.distributed.parallel.launch)
                             fail as their process group forms, as gloo's mesh now and then
                             does: the launch starts them again

STAGE is one of lsreplay.core.layout.STAGES, `eval` (the held-out evaluation), or `checkpoint`
(the policy checkpoint's write, in the background: `checkpoint@1:kill` kills the process
after the weights file of step 1's checkpoint is written, before it is complete); without
@STEP a fault applies at every step. Counts are per process. Stages call `hook(stage,
step, point)` at "start" and "mid"; the store calls `storage_write(key)` before each write
and `partly_written(key)` in its middle. Unset, every hook returns at once.

    LSREPLAY_FAULTS="trees@1:kill" lsreplay train ...
    LSREPLAY_FAULTS="prefixes@0:fail*2,storage:fail*3" lsreplay train ...
"""

from __future__ import annotations

import errno
import logging
import math
import os
import posixpath
import re
import signal
import threading
import time
from dataclasses import dataclass

from lsreplay.core.layout import MODEL_FILE, STAGES, checkpoint_folder

log = logging.getLogger(__name__)

ENV = "LSREPLAY_FAULTS"
ACTIONS = ("kill", "fail", "error", "nan", "stall", "tear", "full", "kill_engine", "interrupt", "kill_rank")
STALL_ENV = "LSREPLAY_STALL_SECONDS"
STALL_UNTIL_ENV = "LSREPLAY_STALL_UNTIL"
_SPEC = re.compile(r"^(?P<target>[a-z_]+)(?:@(?P<step>\d+))?:(?P<action>[a-z_]+)(?:\*(?P<count>\d+))?$")


class InjectedFault(ConnectionError):
    """A transient failure put there by LSREPLAY_FAULTS; a retry succeeds."""


class InjectedError(RuntimeError):
    """A permanent failure put there by LSREPLAY_FAULTS."""


@dataclass
class Fault:
    target: str  # a stage name or "storage"
    step: int | None
    action: str
    remaining: int  # how many more times it fires

    def matches(self, target: str, step: int | None) -> bool:
        return self.remaining > 0 and self.target == target and (self.step is None or self.step == step)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"{ENV}: cannot parse {item!r}; expected STAGE[@STEP]:ACTION[*N], "
                             "e.g. trees@1:kill or storage:fail*3")
        target, action = m["target"], m["action"]
        if target not in (*STAGES, "eval", "checkpoint", "storage", "ranks"):
            raise ValueError(f"{ENV}: unknown target {target!r} in {item!r}; "
                             f"one of {', '.join(STAGES)}, eval, checkpoint, storage, ranks")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {action!r} in {item!r}; one of {', '.join(ACTIONS)}")
        if target in ("storage", "ranks") and (action != "fail" or m["step"]):
            raise ValueError(f"{ENV}: {item!r}: {target} faults are {target}:fail[*N]")
        if action in ("nan", "interrupt") and target != "policy":
            raise ValueError(f"{ENV}: {item!r}: only the policy stage has a loss to make NaN and an optimizer step "
                             "to interrupt")
        if action == "kill_rank" and target != "policy":
            raise ValueError(f"{ENV}: {item!r}: only the policy update has ranks (policy[@STEP]:kill_rank)")
        if action == "kill_engine" and target != "trees":
            raise ValueError(f"{ENV}: {item!r}: only the rollouts call an engine (trees[@STEP]:kill_engine)")
        if action in ("tear", "full") and target != "checkpoint":
            raise ValueError(f"{ENV}: {item!r}: only a checkpoint's write can be torn or find the disk full "
                             f"(checkpoint[@STEP]:{action})")
        count = int(m["count"]) if m["count"] else (1 if action in ("fail", "kill", "stall", "tear", "kill_engine",
                                                                    "interrupt", "kill_rank") else 2**31)
        faults.append(Fault(target, int(m["step"]) if m["step"] else None, action, count))
    return faults


# The parsed faults of the current LSREPLAY_FAULTS value; re-parsed (counters reset) when it changes.
_active: tuple[str, list[Fault]] = ("", [])


def reset() -> None:
    """Forget the counters: the current spec counts afresh (a test setting the spec an
    earlier test in this process used up)."""
    global _active
    _active = ("", [])


def active() -> list[Fault]:
    global _active
    spec = os.environ.get(ENV, "")
    if spec != _active[0]:
        _active = (spec, parse(spec))
    return _active[1]


_lock = threading.Lock()  # stages of one process may run on several threads (rollout shards)


def _take(target: str, step: int | None, actions: tuple[str, ...]) -> Fault | None:
    with _lock:
        for fault in active():
            if fault.action in actions and fault.matches(target, step):
                fault.remaining -= 1
                return fault
    return None


def hook(stage: str, step: int, point: str) -> None:
    """Called by each stage at "start" (after deciding to run) and "mid" (outputs partly written);
    by the policy stage at "stepped" (after an optimizer step, before the update is recorded)."""
    if not os.environ.get(ENV):
        return
    if point == "start":
        if fault := _take(stage, step, ("fail",)):
            log.warning("injected transient fault in stage %s of step %d (%d more)", stage, step, fault.remaining)
            raise InjectedFault(f"injected transient fault in stage {stage} of step {step}")
        if _take(stage, step, ("error",)):
            raise InjectedError(f"injected permanent error in stage {stage} of step {step}")
    elif point == "mid" and _take(stage, step, ("stall",)):
        seconds, until = float(os.environ.get(STALL_ENV, "5")), os.environ.get(STALL_UNTIL_ENV)
        log.warning("injected stall of %s%.1f s in the middle of stage %s of step %d", f"until {until} exists, at most "
                    if until else "", seconds, stage, step)
        _stall(seconds, until)
    elif point == "mid" and _take(stage, step, ("kill",)):
        log.warning("injected kill in the middle of stage %s of step %d", stage, step)
        _kill()
    elif point == "stepped" and _take(stage, step, ("interrupt",)):
        log.warning("injected interruption of stage %s of step %d after its optimizer step", stage, step)
        raise InjectedFault(f"injected interruption of stage {stage} of step {step} after its optimizer step")


def _stall(seconds: float, until: str | None) -> None:
    if until is None:
        time.sleep(seconds)  # one call blocked in C, as a stage in a socket read or a collective is
        return
    deadline = time.monotonic() + seconds
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.1)


def engine_call(stage: str, step: int, pid: int) -> None:
    """Called while a stage's call to the engine process `pid` is in flight (at its progress messages)."""
    if os.environ.get(ENV) and _take(stage, step, ("kill_engine",)):
        log.warning("injected kill of the vLLM engine (pid %d) in the middle of stage %s of step %d", pid, stage, step)
        os.kill(pid, signal.SIGKILL)


def doomed_rank(stage: str, step: int, ranks: int) -> int | None:
    """The rank of a stage's `ranks` processes that a `kill_rank` fault kills (the last), or
    None; taken here, in the stage's process, so that a retry's ranks live."""
    if os.environ.get(ENV) and _take(stage, step, ("kill_rank",)):
        log.warning("injected kill of rank %d of stage %s of step %d as its backward starts", ranks - 1, stage, step)
        return ranks - 1
    return None


def failed_rendezvous() -> bool:
    """Whether a `ranks:fail` fault fails this launch's process group as it forms; taken here,
    in the launching process, so that the launch's next try forms."""
    if os.environ.get(ENV) and (fault := _take("ranks", None, ("fail",))):
        log.warning("injected failure of the ranks' process group as it forms (%d more)", fault.remaining)
        return True
    return False


def kill_this_rank() -> None:
    """The doomed rank (doomed_rank) dies here."""
    _kill()


def _kill() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def loss(stage: str, step: int, value: float) -> float:
    """The loss, or NaN if a `nan` fault is set for this stage and step."""
    if os.environ.get(ENV) and _take(stage, step, ("nan",)):
        log.warning("injected NaN loss in stage %s of step %d", stage, step)
        return math.nan
    return value


def partly_written(key: str) -> None:
    """Called by the store in the middle of writing entry `key`: part of its bytes are
    written, the entry is not in place yet."""
    if not os.environ.get(ENV):
        return
    folder, name = posixpath.split(key)  # checkpoints/policy/step_NNNN, model.safetensors
    step = _policy_checkpoint_step(folder)
    if name == MODEL_FILE and step is not None and folder == checkpoint_folder("policy", step) \
            and _take("checkpoint", step, ("tear",)):
        log.warning("injected kill in the middle of writing %s", key)
        _kill()


def storage_write(key: str) -> None:
    """Called by the store before each write."""
    if not os.environ.get(ENV):
        return
    if fault := _take("storage", None, ("fail",)):
        log.warning("injected transient storage fault writing %s (%d more)", key, fault.remaining)
        raise InjectedFault(f"injected transient storage fault writing {key}")
    if (step := _policy_checkpoint_step(posixpath.dirname(key))) is not None and _take("checkpoint", step, ("full",)):
        raise OSError(errno.ENOSPC, f"No space left on device (injected: {ENV}=checkpoint@{step}:full)", key)


def _policy_checkpoint_step(folder: str) -> int | None:
    """The step of the policy checkpoint that holds `folder` (checkpoints/policy/step_NNNN or
    a folder in it), or None."""
    parts = folder.split("/")
    if parts[:2] != checkpoint_folder("policy", 0).split("/")[:2] or len(parts) < 3:
        return None
    step = parts[2].removeprefix("step_")
    return int(step) if step.isdigit() else None
