"""Nothing waits for ever: a reward function that hangs, a stage that hangs, a Prefect API
that stalls while a pool lease is renewed, devices and pool slots another holder keeps; and
the folder of the device locks is this user's alone."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from flowrun import FAST_RETRIES, REPO, lsreplay_chain, session_database, tiny, unique_pool

from lsreplay.core.config import ConfigError, load_config


def test_a_reward_function_that_hangs_stops_the_stage(tmp_path):
    from lsreplay.data.rewards import Reward, RewardError
    from lsreplay.data.sources import Prompt

    hang = tmp_path / "hang.py"
    hang.write_text("import threading\n\ndef reward(prompt, completion):\n    threading.Event().wait()\n")
    cfg = load_config(None, [f"reward.functions=[{hang}:reward]", "reward.timeout_seconds=1"])
    prompts = [Prompt(index=i, task="t", question="q", answer="a", metadata={}) for i in (3, 5)]
    start = time.monotonic()
    with pytest.raises(RewardError) as stopped:
        Reward(cfg).score(prompts, [["x", "y"], ["z"]], [[[1], [2]], [[3]]], state=None)
    assert time.monotonic() - start < 5
    assert f"reward functions ({hang}:reward) did not score the completions of prompts [3, 5] within " \
           "reward.timeout_seconds=1" in str(stopped.value)
    quick = load_config(None, ["reward.timeout_seconds=1"])  # the default reward, well within it
    exact = Prompt(index=0, task="exact_answer", question="3+4?", answer="7", metadata={})
    assert Reward(quick).score([exact], [["7"]], [[[7]]], state=None).totals == [[1.0]]


def test_a_stage_blocked_in_c_ends_its_process_at_the_deadline_and_the_run_resumes(prefect_server, tiny_model_dir,
                                                                                  tmp_path):
    """Step 0's caching pass blocks in one C call for ten minutes (an injected stall: time.sleep,
    which no interruption between bytecodes reaches, as a socket read or a collective). At
    pool.stage_timeout_seconds the `lsreplay train` process ends, naming the stage, the step,
    where it was blocked and the resume command, and takes what it started with it (Prefect's
    temporary server: no PREFECT_API_URL); that command, in a new process, finishes the run."""
    from lsreplay.core.deadline import TIMED_OUT_EXIT
    from lsreplay.core.run import Run

    run_dir, home = tmp_path / "run", tmp_path / "prefect-home"
    migrated_database(home / "prefect.db")  # a first start on a fresh machine is tests/test_first_run.py's
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}, **FAST_RETRIES,
           "PYTHONPATH": str(REPO), "PREFECT_HOME": str(home), "LSREPLAY_FAULTS": "prefixes@0:stall",
           "LSREPLAY_STALL_SECONDS": "600"}
    start = time.monotonic()
    timed_out = subprocess.run([sys.executable, "-m", "lsreplay.cli", "train", *tiny(run_dir, tiny_model_dir, steps=1),
                                "pool.stage_timeout_seconds=10"], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=300)
    assert time.monotonic() - start < 300  # never the stall's ten minutes
    log = timed_out.stdout + timed_out.stderr
    assert timed_out.returncode == TIMED_OUT_EXIT, log[-3000:]
    assert "stage prefixes of step 0 ran past pool.stage_timeout_seconds=10: ending this process" in log, log[-3000:]
    assert f"continue the run with: lsreplay resume {run_dir}" in log
    assert 'faults.py", line' in log and "in _stall\n    time.sleep(seconds)" in log  # where the stage was blocked
    assert "Starting temporary server" in (home / "temporary-server.log").read_text()
    deadline = time.monotonic() + 20
    while (left := _processes_with(f"PREFECT_HOME={home}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left  # the temporary server ended with the process that started it

    [resumed] = lsreplay_chain([(["resume", str(run_dir), unique_pool()], "")], tmp_path, timeout=300)
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    run = Run(load_config(None, [f"run_dir={run_dir}"]))
    assert run.executions()[0, "prefixes"] == 2 and run.executions()[0, "policy"] == 1, run.executions()
    assert len(run.metrics()) == 1


def migrated_database(path: Path) -> None:
    """A copy of the session server's database at `path`: migrated, as `make setup` leaves
    the user's (a temporary server creating one first spends 10-18 s on it)."""
    path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(session_database())) as source, \
            contextlib.closing(sqlite3.connect(path)) as copy:
        source.backup(copy)


def _processes_with(variable: str) -> list[int]:
    """The processes of this user whose environment holds `variable` (NAME=value)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found


@pytest.fixture
def stalled_api():
    """The URL of an API that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.extend(iter(lambda: server.accept()[0], None)), daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/api"
    server.close()
    for connection in accepted:
        connection.close()


def test_a_lease_renewal_gives_up_before_the_lease_ends(stalled_api, monkeypatch):
    """Against a stalled Prefect API, a renewal gives up after its timeout (RENEW_TIMEOUT_SECONDS,
    a sixth of the lease; 1 s here) and the next one comes at its interval: before, Prefect's
    client waited 60 s a try and retried 5 times, outlasting the 60 s lease many times over."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.pool import LEASE_SECONDS, RENEW_ENV, RENEW_TIMEOUT_SECONDS, _renew

    monkeypatch.setenv(RENEW_ENV, "0.2")
    timeout = 1.0
    warnings: list[tuple[float, str]] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append((time.monotonic(), record.getMessage()))
    logging.getLogger("tasks.pool").addHandler(handler)
    stop, start = threading.Event(), time.monotonic()
    try:
        with temporary_settings(updates={PREFECT_API_URL: stalled_api}):
            # In this context's copy, as the holder starts it: its requests go to that API.
            renewer = threading.Thread(target=contextvars.copy_context().run,
                                       args=(_renew, uuid.uuid4(), 1, stop, timeout), daemon=True)
            renewer.start()
            while len(warnings) < 2 and time.monotonic() - start < 10 * timeout:
                time.sleep(0.2)
    finally:
        stop.set()
        logging.getLogger("tasks.pool").removeHandler(handler)
    assert RENEW_TIMEOUT_SECONDS * 2 < LEASE_SECONDS
    assert len(warnings) >= 2, warnings
    (first, message), (second, _) = warnings[:2]
    # Each try ended at its timeout, not at the client's 60 s or after its retries.
    assert timeout <= first - start < timeout + 3 and timeout <= second - first < timeout + 3, warnings
    assert "could not renew the pool lease" in message and f"within {timeout:.0f} s" in message


def test_a_device_another_holder_keeps_is_waited_for_a_bounded_time(tmp_path, monkeypatch):
    from lsreplay.core.devices import LOCK_DIR_ENV, DeviceWaitTimeout, hold_devices

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    pool = load_config(None, [f"pool.name=wait-{uuid.uuid4().hex[:8]}", "pool.wait_seconds=1.5"]).pool
    with hold_devices(pool, 1):  # another holder (its own lock file descriptor)
        start = time.monotonic()
        with pytest.raises(DeviceWaitTimeout, match=r"waited pool.wait_seconds=1.5 for devices another run on this "
                                                    r"machine holds"):
            with hold_devices(pool, 1):
                pass
        assert 1.5 <= time.monotonic() - start < 5


def test_pool_slots_another_holder_keeps_are_waited_for_a_bounded_time(prefect_server, tmp_path, monkeypatch):
    from lsreplay.core.devices import LOCK_DIR_ENV
    from tasks.pool import ensure_pool, pool_devices, release_parked

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    pool = load_config(None, [f"pool.name=slots-{uuid.uuid4().hex[:8]}", "pool.wait_seconds=2"]).pool
    ensure_pool(pool)
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with pool_devices(pool):
            held.set()
            done.wait(30)

    threading.Thread(target=holder, daemon=True).start()
    assert held.wait(30)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"1 slot\(s\) not free within pool.wait_seconds=2"):
            with pool_devices(pool):
                pass
        assert time.monotonic() - start < 15
    finally:
        done.set()
        release_parked()


def test_the_device_lock_folder_is_this_users_alone(tmp_path, monkeypatch):
    from lsreplay.core.devices import LOCK_DIR_ENV, hold_devices, lock_dir

    monkeypatch.delenv(LOCK_DIR_ENV, raising=False)
    assert lock_dir().name == f"lsreplay-devices-{os.getuid()}"  # per user, not one shared folder
    pool = load_config(None, [f"pool.name=own-{uuid.uuid4().hex[:8]}"]).pool
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    with hold_devices(pool, 1):
        pass
    folder = tmp_path / "locks"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()] == [0o600]
    folder.chmod(0o1777)  # as the shared folder used to be
    with pytest.raises(ConfigError, match=r"is not this user's alone .* mode drwxrwxrwt.*Remove it"):
        with hold_devices(pool, 1):
            pass
