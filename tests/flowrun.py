"""Helpers shared by the flow-level tests (resume, faults, S3, bad input): a tiny config,
one reference run per test session, and `lsreplay` commands run in processes of their own
against the session's Prefect test server.

A plain module, not a conftest: the test modules import from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Import Prefect (which sets up its log handlers on the current sys.stderr) at collection,
# not inside a test using capsys, whose stream is closed after that test. lsreplay's own
# logs go to the Prefect UI too, as under the `lsreplay` command.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lsreplay")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # tests call stages outside flows
import flows.train  # noqa: F401

# Transient faults injected into the reference run: it must still end bit-identical to a
# run without them (test_resume compares it with a run killed and resumed five times).
REFERENCE_FAULTS = "storage:fail*2,prefixes@0:fail"

# Retries in tests: (almost) immediate.
FAST_RETRIES = {"LSREPLAY_RETRY_DELAY": "0.05", "LSREPLAY_STORAGE_BACKOFF": "0.01", "LSREPLAY_STORAGE_RETRIES": "2"}


def tiny(run_dir, model_dir, steps: int = 2) -> list[str]:
    """Overrides for a tiny two-step run of every stage (a pool of its own, see unique_pool)."""
    return [f"run_dir={run_dir}", f"model.path={model_dir}", f"steps={steps}", "data.size=8",
            "data.prompts_per_step=1", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
            "rollout.max_new_tokens=6", "drafter.steps=2", "drafter.batch_size=2", "optim.lr=1e-3",
            unique_pool()]


def stall_until_drafter_checkpointed(monkeypatch, run_dir: Path) -> None:
    """Injected stalls (LSREPLAY_FAULTS' STAGE@STEP:stall) last until step 0's drafter has
    written its spot checkpoint: a minute at most, however busy the machine."""
    from lsreplay.core.faults import STALL_ENV, STALL_UNTIL_ENV
    from lsreplay.stages.drafter import SPOT_STATE

    monkeypatch.setenv(STALL_ENV, "60")
    monkeypatch.setenv(STALL_UNTIL_ENV, str(run_dir / "checkpoints/drafter/step_0000" / SPOT_STATE))


def session_database() -> str:
    """The path of the session Prefect server's SQLite database (prefect_test_harness's)."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    return PREFECT_API_DATABASE_CONNECTION_URL.value().split(":///")[1]


def unique_pool() -> str:
    """A pool nobody else holds: a process killed while holding a slot keeps it until its
    lease expires (a minute), which later runs on the same pool would wait out."""
    return f"pool.name=test-{uuid.uuid4().hex[:10]}"


@dataclass
class Reference:
    run_dir: Path
    flow_run_id: object
    metrics: list[dict]
    warnings: list[str] = field(default_factory=list)


_reference: Reference | None = None


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reference_run(tmp_path_factory, model_dir) -> Reference:
    """One uninterrupted tiny run in this process (with transient faults injected), shared
    by the tests of the session. Needs the prefect_server fixture."""
    global _reference
    if _reference is None:
        from flows.train import train

        run_dir = tmp_path_factory.mktemp("reference") / "run"
        capture = _Capture()
        logging.getLogger("lsreplay").addHandler(capture)
        saved = {k: os.environ.get(k) for k in [*FAST_RETRIES, "LSREPLAY_FAULTS"]}
        os.environ.update(FAST_RETRIES, LSREPLAY_FAULTS=REFERENCE_FAULTS)
        try:
            state = train(overrides=tiny(run_dir, model_dir), return_state=True)
        finally:
            logging.getLogger("lsreplay").removeHandler(capture)
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        _reference = Reference(run_dir, state.state_details.flow_run_id, state.result(), capture.messages)
    return _reference


def step0_copy(reference: Reference, dest: Path) -> Path:
    """A copy of the reference run as it stood after step 0, saved as a one-step run."""
    shutil.copytree(reference.run_dir, dest)
    for path in ["step_0001", "checkpoints/policy/step_0001", "checkpoints/drafter/step_0001", "executions"]:
        shutil.rmtree(dest / path)
    (dest / "curves.png").unlink()
    metrics = dest / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])
    saved = json.loads((dest / "config.json").read_text())
    saved["config"]["steps"] = 1  # not part of the result hash
    (dest / "config.json").write_text(json.dumps(saved))
    return dest


class ForkServer:
    """A tests/forkrun.py process: `lsreplay` commands forked from one import of the flow."""

    def __init__(self, env: dict):
        self.process = subprocess.Popen([sys.executable, str(REPO / "tests/forkrun.py")], cwd=REPO, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)  # its group: the server and the command running
        assert self.reply(120) == "ready"

    def reply(self, timeout: float) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise AssertionError(f"tests/forkrun.py {'ended' if ready else f'gave no answer in {timeout} s'}")
        return line.strip()

    def chain(self, env: dict, jobs: list[dict], timeout: float) -> list[dict]:
        self.process.stdin.write(json.dumps({"env": env, "jobs": jobs}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.reply(timeout))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


# Idle fork servers by the environment they started in; a chain takes one or starts
# one (two chains at once, as in test_run_lock, run in two servers).
_IDLE_SERVERS: dict[tuple, list[ForkServer]] = {}
_SERVERS_LOCK = threading.Lock()


def lsreplay_chain(jobs: list[tuple[list[str], str]], log_dir: Path, timeout: float = 400,
                   threads: int | None = None) -> list[dict]:
    """Several `lsreplay ARGS` commands, each in its own process with LSREPLAY_FAULTS set as
    given, one after another (forked by a tests/forkrun.py server: the imports are paid once
    a session), each starting with `threads` torch threads (default: the machine's). Returns
    each command's {"returncode" (-9 when SIGKILLed), "log" (its output)}."""
    spec = [{"args": args, "env": {"LSREPLAY_FAULTS": faults}, "log": str(log_dir / f"command-{i}.log"),
             **({"threads": threads} if threads else {})} for i, (args, faults) in enumerate(jobs)]
    results = _forked(spec, timeout)
    for r in results:
        r["log"] = Path(r["log"]).read_text()
    return results


def run_bench(name: str, args: list[str], log_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python bench/NAME.py ARGS` in REPO, forked by a tests/forkrun.py server (as
    lsreplay_chain's commands: the imports paid once a session), its output and errors apart."""
    script, out, err = REPO / "bench" / f"{name}.py", log_dir / f"{name}.out", log_dir / f"{name}.err"
    [result] = _forked([{"script": str(script), "args": args, "log": str(out), "err": str(err)}], timeout)
    return subprocess.CompletedProcess([str(script), *args], result["returncode"], out.read_text(), err.read_text())


def _forked(jobs: list[dict], timeout: float) -> list[dict]:
    """tests/forkrun.py's jobs, one after another, in an idle server started in this
    environment (with the session's Prefect server and quick retries)."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()  # none outside the prefect_server fixture: a script that needs none
    env = {**os.environ, **FAST_RETRIES, **({"PREFECT_API_URL": api} if api else {}), "PYTHONPATH": str(REPO)}
    # lsreplay reads its variables when it runs, pytest's change every test: a server is for
    # the rest of the environment it started in (Prefect's settings, read at import).
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(("LSREPLAY_", "PYTEST_"))))
    with _SERVERS_LOCK:
        idle = _IDLE_SERVERS.setdefault(key, [])
        server = idle.pop() if idle else None
    server = server or ForkServer(env)
    results = server.chain(env, jobs, timeout)  # a server that failed is killed, not returned
    with _SERVERS_LOCK:
        _IDLE_SERVERS[key].append(server)
    return results


def tree_records(run_dir: Path, step: int) -> list[dict]:
    """The tree records of a step of the run in `run_dir`, in prompt order (from its rollout shards' files)."""
    from lsreplay.core.config import load_config
    from lsreplay.core.run import Run
    from lsreplay.stages.common import load_trees

    return load_trees(Run(load_config(None, [f"run_dir={run_dir}"])), step)[0]


def digests(run_dir: Path, *folders: str) -> dict[str, str]:
    """sha256 of every file under the folders, done markers, checkpoint records and rollout
    decision logs (which hold timings) excepted."""
    out = {}
    for folder in folders:
        for p in sorted((run_dir / folder).rglob("*")):
            if p.is_file() and not p.name.endswith(".done.json") and not p.name.startswith("decisions_") \
                    and p.name != "checkpoint.json":
                out[str(p.relative_to(run_dir))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
