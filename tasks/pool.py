"""The accelerator pool as a Prefect global concurrency limit plus per-device locks, and the
handoff of both from one stage to the next stage of the same process."""

from __future__ import annotations

import contextvars
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from lsreplay.core.config import PoolConfig
from lsreplay.core.devices import any_held, hold_devices

log = logging.getLogger(__name__)

# A holder renews its lease while it runs; if its process dies, the slots come back when
# the lease expires (the server's repossessor looks every 15 s). 60 s is the server's minimum.
# Renewed every third of that, so that one failed renewal still leaves two more tries before
# the lease ends. LSREPLAY_LEASE_RENEW_SECONDS sets the interval (tests renew often). Each
# try gives up after RENEW_TIMEOUT_SECONDS and is not retried by Prefect's client, whose own
# 60 s timeout and 5 retries would outlast the lease: the next try comes at its time, and
# two tries that both hang still end before the lease does.
LEASE_SECONDS = 60
RENEW_ENV = "LSREPLAY_LEASE_RENEW_SECONDS"
RENEW_TIMEOUT_SECONDS = LEASE_SECONDS / 6


def ensure_pool(pool: PoolConfig) -> None:
    """Create the pool's concurrency limit if it does not exist yet, or set its size to
    pool.slots. On Prefect's temporary server, also take back slots stranded by a killed run."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(pool.name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=pool.name, limit=pool.slots))
            return
        if limit.limit != pool.slots:
            client.update_global_concurrency_limit(pool.name, GlobalConcurrencyLimitUpdate(limit=pool.slots))
    if not PREFECT_API_URL.value():
        free_stranded_slots(pool)


def free_stranded_slots(pool: PoolConfig) -> int:
    """Zero the pool's held slots if no process on this machine holds one of its devices;
    returns how many were freed.

    A temporary Prefect server keeps slot leases in its own memory and runs no repossessor,
    so the slots of a run killed with it stay taken in the database for good, and the next
    run would wait forever. A holder always holds a device lock (pool_devices), and those
    die with their process: no lock held means no live holder on this machine."""
    with get_client(sync_client=True) as client:
        held = client.read_global_concurrency_limit_by_name(pool.name).active_slots
        if held == 0 or any_held(pool, max(pool.slots, held)):
            return 0
        client.update_global_concurrency_limit(pool.name, GlobalConcurrencyLimitUpdate(active_slots=0))
    log.warning("pool %r: %d slots were held with no live holder (a run killed with its temporary "
                "Prefect server); freed them", pool.name, held)
    return held


@contextmanager
def pool_devices(pool: PoolConfig, count: int = 1, on: list[int] | None = None):
    """Hold `count` pool slots and yield the device indices they stand for: those of `on` if
    given (waiting for them if another holder has them). A block that ends well leaves them to
    this process's next holder for HANDOFF_SECONDS (HANDOFF)."""
    holdings = HANDOFF.take(pool, count, on) or [HANDOFF.hold(pool, count, on)]
    try:
        yield [device for holding in holdings for device in holding.devices]
    except BaseException:  # a failed stage's device may be unusable: give it back now
        for holding in holdings:
            holding.give_back()
        raise
    for holding in holdings:
        HANDOFF.park(pool.name, holding)


def release_parked() -> None:
    """Give back at once every slot this process holds for a next holder (a run's end)."""
    HANDOFF.release_all()


# How long a stage's slots and devices wait for the next stage of this process. The flow
# submits the next stage within a fraction of a second; another run waiting for the pool
# waits at most this much longer.
HANDOFF_SECONDS = 5.0


@dataclass(eq=False)  # one holding is itself, whatever its devices
class _Holding:
    """Slots held under one lease, and the locked devices they stand for."""
    devices: list[int]
    locks: ExitStack  # closing it unlocks the devices, then returns the slots to the server

    def give_back(self) -> None:
        try:
            self.locks.close()
        except Exception as e:  # the lease expires on its own; the device locks are already gone
            log.warning("could not give back pool slots: %s: %s", type(e).__name__, e)


class Handoff:
    """Slots and devices that finished stages left to the next stage of this process.

    Consecutive stages (rollouts, caching pass, update) hand their slots on instead of each
    giving them back to the server and asking again: two round trips fewer per stage (each
    a write of the server's database), and the next stage computes on the device that holds
    its resident state. A holding left HANDOFF_SECONDS unused, or wanted by a thread of this
    process that waits for the server, goes back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[str, list[_Holding]] = defaultdict(list)
        self._waiting: Counter = Counter()  # per pool: threads of this process asking the server

    def hold(self, pool: PoolConfig, count: int, on: list[int] | None = None) -> _Holding:
        """`count` slots from the server, and free devices for them, those of `on` if given
        (both may wait)."""
        with self._lock:
            self._waiting[pool.name] += 1
        try:
            with ExitStack() as locks:
                locks.enter_context(_slots(pool, count))
                devices = locks.enter_context(hold_devices(pool, count, on))
                return _Holding(devices, locks.pop_all())
        finally:
            with self._lock:
                self._waiting[pool.name] -= 1

    def take(self, pool: PoolConfig, count: int, on: list[int] | None = None) -> list[_Holding] | None:
        """Parked holdings of exactly `count` slots in all, the lowest devices first (as
        hold_devices takes them), only devices of `on` if given; or None. If the parked ones
        of `on`'s devices do not add up to `count`, they go back: they would keep the server's
        slots and the devices from us. Those of other devices (the update's, to a rollout
        shard on pool.rollout_devices) stay for their own next stage."""
        with self._lock:
            parked, taken, slots = self._parked[pool.name], [], 0
            mine = [h for h in parked if on is None or set(h.devices) <= set(on)]
            for holding in sorted(mine, key=lambda h: min(h.devices)):
                if slots + len(holding.devices) <= count:
                    taken.append(holding)
                    slots += len(holding.devices)
            if slots == count:
                for holding in taken:
                    parked.remove(holding)
                return taken
            for holding in mine:
                parked.remove(holding)
        for holding in mine:
            holding.give_back()
        return None

    def park(self, pool_name: str, holding: _Holding) -> None:
        with self._lock:
            if not self._waiting[pool_name]:
                self._parked[pool_name].append(holding)
                timer = threading.Timer(HANDOFF_SECONDS, contextvars.copy_context().run,
                                        (self._expire, pool_name, holding))
                timer.daemon = True
                timer.start()
                return
        holding.give_back()

    def _expire(self, pool_name: str, holding: _Holding) -> None:
        with self._lock:
            if holding not in self._parked[pool_name]:
                return  # taken by a next holder
            self._parked[pool_name].remove(holding)
        holding.give_back()

    def release_all(self) -> None:
        with self._lock:
            parked = [h for holdings in self._parked.values() for h in holdings]
            self._parked.clear()
        for holding in parked:
            holding.give_back()


HANDOFF = Handoff()


def _forget_parked() -> None:
    global HANDOFF
    HANDOFF = Handoff()


# A forked child holds none of its parent's slots: their leases and device locks are the parent's.
os.register_at_fork(after_in_child=_forget_parked)


@contextmanager
def _slots(pool: PoolConfig, count: int):
    """`count` slots of the pool's limit, waited for up to pool.wait_seconds (then
    TimeoutError), under a lease a thread renews until the block ends.

    The lease is this process's, not a task run's: Prefect's own acquisition records it in
    the task run's ConcurrencyContext, which releases it when that task ends, while a
    holding outlives its task (HANDOFF): the server counted the slots free under the next
    stage, and every renewal got 410 Gone."""
    try:
        lease_id = _acquire_lease(pool.name, count, pool.wait_seconds or None)
    except TimeoutError as e:
        raise TimeoutError(f"pool {pool.name!r}: {count} slot(s) not free within pool.wait_seconds="
                           f"{pool.wait_seconds:g}: another run holds them (`prefect gcl inspect {pool.name}`), "
                           "or a killed run's, until their lease expires; raise pool.wait_seconds") from e
    stop = threading.Event()
    # In this context's copy: renewals go to the server (PREFECT_API_URL) the lease came from.
    renewer = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease_id, count, stop),
                               daemon=True, name=f"lease-{pool.name}")
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()  # a renewal on its way would meet the released lease (410) and report it gone
        _unless_busy(lambda client: client.release_concurrency_slots_with_lease(lease_id))


def _acquire_lease(name: str, count: int, timeout: float | None) -> UUID:
    """A lease on `count` slots of the limit `name`, asked for again after the server's
    Retry-After while they are taken, for up to `timeout` seconds (None: no limit)."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    while True:
        try:
            granted = _unless_busy(lambda client: client.increment_concurrency_slots_with_lease(
                names=[name], slots=count, mode="concurrency", lease_duration=LEASE_SECONDS)).json()
        except PrefectHTTPStatusError as e:
            if e.response.status_code != 423:  # 423 Locked: the slots are taken
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{count} slot(s) of {name!r} not free in time") from None
            time.sleep(min(float(e.response.headers.get("Retry-After", 1)), left))
            continue
        if not granted["limits"]:
            raise RuntimeError(f"Prefect has no concurrency limit {name!r} (deleted while the run went on?): "
                               "the run creates it at its start; run again")
        return UUID(granted["lease_id"])


class ServerBusy(Exception):
    """Prefect's server answered 503: a transient failure of its database. On SQLite
    (Prefect's temporary server, or `prefect server start` without Postgres) the slot
    requests meet one whenever another write lands between their read and their write."""


def _raise_if_busy(response) -> None:
    if response.status_code == 503:
        raise ServerBusy(f"Prefect's server answered 503 to {response.request.method} {response.request.url.path}")


# Pauses before asking again where the server was busy: a database busy a moment is free
# again within milliseconds. Prefect's client waits 2 s before its first retry: a third to
# half of the tests' tiny two-step runs took 2 s longer (5.2 s instead of 3.2 s).
BUSY_PAUSES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.5, 1.0, 2.0, 4.0)


def _unless_busy(call, timeout: float | None = None, client_retries: int | None = None):
    """`call(client)` with a client of Prefect's API, asked again after BUSY_PAUSES where
    the server was busy (ServerBusy once they are spent). `timeout`: each request's, and
    the most all of them take; `client_retries`: Prefect's client's own, for other
    failures (PREFECT_CLIENT_MAX_RETRIES if None)."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    httpx_settings = {"event_hooks": {"response": [_raise_if_busy]}} | ({"timeout": timeout} if timeout else {})
    retries = {} if client_retries is None else {PREFECT_CLIENT_MAX_RETRIES: client_retries}
    with temporary_settings(updates=retries), get_client(httpx_settings=httpx_settings, sync_client=True) as client:
        for pause in (*BUSY_PAUSES, None):
            try:
                return call(client)
            except ServerBusy:
                if pause is None or time.monotonic() + pause > deadline:
                    raise
                log.debug("Prefect's server was busy; asking again in %.2f s", pause)
            time.sleep(pause)


def _renew(lease_id, slots: int, stop: threading.Event, timeout: float = RENEW_TIMEOUT_SECONDS) -> None:
    interval = float(os.environ.get(RENEW_ENV, LEASE_SECONDS / 3))
    while not stop.wait(interval) and _renew_once(lease_id, slots, interval, timeout):
        pass


def _renew_once(lease_id, slots: int, interval: float, timeout: float) -> bool:
    """One renewal, given up after `timeout` seconds (a failure is logged); False once the lease is gone."""
    try:
        _unless_busy(lambda client: client.renew_concurrency_lease(lease_id=lease_id, lease_duration=LEASE_SECONDS),
                     timeout=timeout, client_retries=0)
    except Exception as e:
        if isinstance(e, PrefectHTTPStatusError) and e.response.status_code == 410:
            log.error("the pool lease %s is gone from the Prefect server (expired or revoked): it counts its %d "
                      "slots free while their stage still runs", lease_id, slots)
            return False
        # The server may answer the next try, well before the lease ends.
        log.warning("could not renew the pool lease %s within %.0f s (next try in %.1f s): %s: %s", lease_id,
                    timeout, interval, type(e).__name__, e)
    return True
