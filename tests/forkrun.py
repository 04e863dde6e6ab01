"""A fork server for `lsreplay` commands and Python scripts: it imports the CLI and the flow
once (about 10 s of CPU), then forks a child per command, so that a test session pays the
imports once per worker, not once per command. A child runs `lsreplay.cli.main(args)` exactly
as the `lsreplay` executable does, or a script as `python SCRIPT ARGS` does (`__main__`, its
folder first on sys.path), in the environment the test sent (with its own additions, e.g.
LSREPLAY_FAULTS), and may die by a signal (an injected SIGKILL).

    python tests/forkrun.py   (started by tests/flowrun.py's lsreplay_chain and run_bench)

It reads one JSON line per chain on stdin, {"env": {...}, "jobs": [{"args": [...], "env":
{...}, "log": "path for the child's output", "err": "path for its stderr (default: the log)",
"script": "path (default: the lsreplay command)", "threads": N}, ...]}, runs the jobs one
after another and writes one JSON line, [{"returncode", "log"}, ...], per chain; it ends at
the end of its input. Nothing in this process touches torch, Prefect's client or threads before
forking. A child starts with N torch threads (this process's default if absent), as a process
on a machine with N cores would. Settings read at import (Prefect's API URL) are this
process's: lsreplay_chain starts another server where they differ.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager


@contextmanager
def without_flow_heartbeats():
    """Prefect's settings, but a flow run sends no heartbeats. A flow run called from Python
    ends by joining its heartbeat thread, which sleeps in whole seconds: a tiny two-step run
    took 2.19 s instead of 2.77 s (the mean of 8). Nothing in the tests watches heartbeats."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def child(env: dict, job: dict) -> None:
    """The forked child: run one job, never return."""
    code = 70
    try:
        os.environ.clear()
        os.environ.update({**env, **job.get("env", {})})
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the chains to come are the server's input, not a command's
        os.dup2(os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if "err" in job else 1, 2)
        if "threads" in job:
            import torch

            torch.set_num_threads(job["threads"])
        try:
            with without_flow_heartbeats():
                code = main_of(job)
        except SystemExit as e:  # as the interpreter ends on it: sys.exit("message") prints it, exits 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main_of(job: dict) -> int:
    """The job's command, as its executable runs it; its exit status."""
    if "script" not in job:
        from lsreplay import cli

        return cli.main(job["args"])
    import runpy

    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
    runpy.run_path(job["script"], run_name="__main__")
    return 0


def run(env: dict, job: dict) -> dict:
    pid = os.fork()
    if pid == 0:
        child(env, job)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return {"returncode": code, "log": job["log"]}


def main() -> None:
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lsreplay")
    import flows.train  # noqa: F401  (the heavy imports, once)
    from lsreplay import cli  # noqa: F401
    from lsreplay.data.sources import reasoning_gym_tasks

    reasoning_gym_tasks()  # imported where prompts are generated: ~2 s more a command, paid here once
    print("ready", flush=True)
    for line in sys.stdin:
        chain = json.loads(line)
        print(json.dumps([run(chain["env"], job) for job in chain["jobs"]]), flush=True)


if __name__ == "__main__":
    main()
