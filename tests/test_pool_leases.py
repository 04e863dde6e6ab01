"""A held pool slot stays held on the Prefect server for as long as its stage runs, across
the hand-off from one stage's task to the next one's, and its lease renews without fail.

(Leases acquired inside a task run used to be released by Prefect when that task ended,
while the next stage still computed on the handed-off slot: the server counted it free, and
every renewal got 410 Gone.) Renewals come every LSREPLAY_LEASE_RENEW_SECONDS here, so that
a stage of a second or two sees several; the lease itself has its real duration."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid

import pytest
from flowrun import session_database, tiny
from test_pool import active_slots

from lsreplay.core.config import PoolConfig
from lsreplay.core.faults import ENV as FAULTS_ENV
from lsreplay.core.faults import STALL_ENV

RENEW_SECONDS = 0.3


@pytest.fixture
def pool_log(monkeypatch):
    """Renewals every RENEW_SECONDS; yields the warnings and errors tasks.pool logs."""
    from tasks.pool import RENEW_ENV

    monkeypatch.setenv(RENEW_ENV, str(RENEW_SECONDS))
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("tasks.pool")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_a_slot_handed_to_the_next_task_stays_held_on_the_server(prefect_server, pool_log):
    from prefect import flow, task

    from tasks.pool import ensure_pool, pool_devices, release_parked

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=2)
    ensure_pool(pool)

    @task
    def first() -> list[int]:
        with pool_devices(pool) as devices:
            return devices

    @task
    def second() -> tuple[list[int], list[int]]:
        with pool_devices(pool) as devices:  # the first one's, handed on
            seen = [active_slots(pool.name)]
            time.sleep(5 * RENEW_SECONDS)  # renewed meanwhile
            return devices, seen + [active_slots(pool.name)]

    @flow
    def stages():
        devices = first.submit().result()
        return devices, second.submit().result()

    devices, (handed, seen) = stages()
    assert handed == devices and seen == [1, 1], seen
    release_parked()
    assert active_slots(pool.name) == 0
    assert pool_log == []


def test_every_stage_of_a_run_holds_its_slot_on_the_server_while_it_runs(prefect_server, tiny_model_dir, tmp_path,
                                                                        monkeypatch, pool_log):
    """Stalls in step 0's rollouts (a fresh lease), step 0's caching pass (handed on by the
    rollout shard) and step 1's rollouts (handed on through every stage of step 0): at each,
    the server's active slots for the pool are the one slot the run holds."""
    from flows.train import train

    overrides = tiny(tmp_path / "run", tiny_model_dir)
    (pool,) = [o.split("=", 1)[1] for o in overrides if o.startswith("pool.name=")]
    monkeypatch.setenv(FAULTS_ENV, "trees@0:stall,prefixes@0:stall,trees@1:stall")
    monkeypatch.setenv(STALL_ENV, str(5 * RENEW_SECONDS))
    held: list[tuple[str, int]] = []

    class AtEachStall(logging.Handler):  # in the stalling stage's thread, as the stall begins
        def emit(self, record):
            if record.getMessage().startswith("injected stall"):
                held.append((record.getMessage().split("stage ")[1], active_slots(pool)))

    watch = AtEachStall()
    logging.getLogger("lsreplay.core.faults").addHandler(watch)
    try:
        train(overrides=overrides)
    finally:
        logging.getLogger("lsreplay.core.faults").removeHandler(watch)
    assert held == [("trees of step 0", 1), ("prefixes of step 0", 1), ("trees of step 1", 1)]
    assert active_slots(pool) == 0  # all given back at the run's end
    assert pool_log == []


def test_a_slot_request_the_busy_server_refuses_is_asked_again_at_once(prefect_server, caplog):
    """While another writer holds the server's SQLite database (here a transaction of this
    test), Prefect's server answers the slot request 503, which Prefect's client would ask
    again only after 2 s: the pool asks again within a fraction of a second, and has the slot
    soon after the database is free."""
    from tasks.pool import BUSY_PAUSES, ensure_pool, pool_devices, release_parked

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=1)
    ensure_pool(pool)
    database = sqlite3.connect(session_database(), isolation_level=None)
    acquired: list[float] = []

    def holder() -> None:
        with pool_devices(pool):
            acquired.append(time.monotonic())

    def busy() -> list[str]:
        return [r.getMessage() for r in caplog.records if "was busy" in r.getMessage()]

    caplog.set_level(logging.DEBUG, logger="tasks.pool")
    database.execute("BEGIN IMMEDIATE")  # the database's write lock, as the server's other writers take it
    asking = threading.Thread(target=holder)
    asking.start()
    deadline = time.monotonic() + 30
    while not busy() and time.monotonic() < deadline:  # until the server has answered busy
        time.sleep(0.01)
    time.sleep(0.2)  # and again
    database.execute("COMMIT")
    freed = time.monotonic()
    asking.join(30)
    database.close()
    assert len(busy()) >= 2 and acquired, (busy(), acquired)
    assert acquired[0] - freed < max(BUSY_PAUSES[:5]) + 0.5, acquired[0] - freed  # Prefect's client: 1.6 s or more
    release_parked()
    assert active_slots(pool.name) == 0
