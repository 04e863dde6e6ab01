"""Run several `lsreplay` commands one after another, each in its own process, paying the
imports (about 10 s of CPU) once: this script imports the CLI and the flow, then forks a
child per command. A child runs `lsreplay.cli.main(args)` exactly as the `lsreplay`
executable does, with its own environment additions (e.g. LSREPLAY_FAULTS), and may die
by a signal (an injected SIGKILL).

    python tests/forkrun.py JOBS.json  ->  prints a JSON list of {"returncode", "log"}

JOBS.json is a list of {"args": [...], "env": {...}, "log": "path for the child's output",
"threads": N}. Nothing in this parent touches torch, Prefect's client or threads before
forking. A child starts with N torch threads (the parent's default if absent), as a
process on a machine with N cores would.
"""

from __future__ import annotations

import json
import os
import sys


def main(jobs_file: str) -> None:
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lsreplay")
    import flows.train  # noqa: F401  (the heavy imports, once)
    from lsreplay import cli
    from lsreplay.data.sources import reasoning_gym_tasks

    reasoning_gym_tasks()  # imported where prompts are generated: ~2 s more a command, paid here once

    results = []
    with open(jobs_file) as f:
        jobs = json.load(f)
    for job in jobs:
        pid = os.fork()
        if pid == 0:  # the child: one `lsreplay` command
            code = 70
            try:
                os.environ.update(job.get("env", {}))
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                if "threads" in job:
                    import torch

                    torch.set_num_threads(job["threads"])
                try:
                    code = cli.main(job["args"])
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        results.append({"returncode": code, "log": job["log"]})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
