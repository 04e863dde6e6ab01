"""A first run on a fresh machine: the real `lsreplay train`, with a fresh PREFECT_HOME and no
PREFECT_API_URL, starts Prefect's temporary server (which creates its database first),
finishes, and shows no traceback, no ERROR line and no warning that is not about the run;
with no server to run on, it says so in one line and exits 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from flowrun import REPO, tiny


def lsreplay(args: list[str], cwd, **env: str) -> subprocess.CompletedProcess:
    """`lsreplay ARGS` in a process of its own, with none of this session's Prefect settings."""
    fresh = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run([sys.executable, "-m", "lsreplay.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**fresh, "PYTHONPATH": str(REPO), **env}, timeout=600)


def test_a_first_run_starts_prefect_quietly_and_finishes(tiny_model_dir, tmp_path):
    home = tmp_path / "prefect-home"
    done = lsreplay(["train", *tiny(tmp_path / "run", tiny_model_dir, steps=1)], tmp_path, PREFECT_HOME=str(home))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "finished 1 steps" in done.stdout
    assert "Traceback" not in output and "ERROR" not in output, output[-3000:]
    # Only lsreplay's own warnings, about the run (none of Prefect's about its task timeouts),
    # and no line per stage saying that nothing needed doing.
    assert [line for line in output.splitlines() if "WARNING" in line and "lsreplay." not in line] == [], output[-3000:]
    assert "not regenerating" not in output
    assert (home / "prefect.db").is_file()  # the temporary server's database, made by this run
    assert "Starting temporary server" in (home / "temporary-server.log").read_text()


def test_without_a_prefect_server_a_run_says_what_to_do_in_one_line(tiny_model_dir, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    done = lsreplay(["train", *tiny(tmp_path / "run", tiny_model_dir, steps=1)], tmp_path, PREFECT_API_URL=url,
                    PREFECT_HOME=str(tmp_path / "prefect-home"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"lsreplay: error: the Prefect server at "
                                                           f"PREFECT_API_URL={url} does not answer")
    assert not (tmp_path / "run").exists()  # nothing started
