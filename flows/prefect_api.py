"""The Prefect API a command's flow runs against: the server PREFECT_API_URL names, else a
temporary one, started here before the flow so that it starts reliably and quietly.

Left to Prefect, the temporary server starts on the flow's first API call and gets 20 s. On
a fresh machine it first creates its database: 18 s of start-up, 12 s of them migrations
(2 idle cores; with the database made by `make setup`, 6.5 s), so a busy machine timed out
with a traceback. Started here, it gets STARTUP_SECONDS and a second try (migrations commit
one by one: a try cut short keeps those it finished). Its own output goes to a log file
instead of the user's screen: errors of its telemetry heartbeat, which fails without network
and raced the migrations for the database (`database is locked` tracebacks); that heartbeat
is off too. Prefect's own calls then find this server running: a process has one.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

from lsreplay.core.config import ConfigError

log = logging.getLogger(__name__)

# Per try; the environment's PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS instead, if set.
STARTUP_SECONDS = 90
TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
TRIES = 2
ADVICE = ("start one with `prefect server start` and point PREFECT_API_URL at it "
          "(export PREFECT_API_URL=http://127.0.0.1:4200/api), then run again")


class PrefectUnavailable(ConfigError):
    """No Prefect API to run the flow against (bad input of the environment: the command
    exits 2); the message says what to do."""


def connect() -> str:
    """Make sure the flow has an API: check the configured server answers, or start the
    temporary one. Returns the API's URL; PrefectUnavailable if there is none."""
    if url := PREFECT_API_URL.value():
        with get_client(sync_client=True) as client:
            error = client.api_healthcheck()
        if error is not None:
            raise PrefectUnavailable(f"the Prefect server at PREFECT_API_URL={url} does not answer "
                                     f"({type(error).__name__}: {error}); start it (`prefect server start`), "
                                     "or unset PREFECT_API_URL to run on a temporary server")
        return url
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        raise PrefectUnavailable(f"PREFECT_API_URL is not set and temporary Prefect servers are off "
                                 f"(PREFECT_SERVER_ALLOW_EPHEMERAL_MODE): {ADVICE}")
    return _start_temporary_server(Path(PREFECT_HOME.value()) / "temporary-server.log")


def _start_temporary_server(log_path: Path) -> str:
    from prefect.server.api.server import SubprocessASGIServer  # the server's stack: only to start one

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the server inherits it
    timeout = int(os.environ.get(TIMEOUT_ENV) or STARTUP_SECONDS)  # the user's, if set
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_bytes(b"")  # this start's log only
    log.info("starting Prefect's temporary server (PREFECT_API_URL is not set); its log: %s", log_path)
    for _ in range(TRIES):
        server = SubprocessASGIServer()
        with _output_to(log_path):
            try:
                server.start(timeout=timeout)
                return server.api_url
            except Exception:  # it did not answer in time, or its process died
                code = server.server_process.poll() if server.server_process else None
                server.stop()
    failure = f"did not answer within {timeout} s" if code is None else f"exited with code {code}"
    raise PrefectUnavailable(f"Prefect's temporary server {failure}, {TRIES} times (its log: {log_path}): "
                             f"{ADVICE}, or give it longer ({TIMEOUT_ENV})")


@contextmanager
def _output_to(path: Path):
    """This process's stdout and stderr, as file descriptors, go to `path` (appended): a
    process started meanwhile writes there for as long as it lives."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
