"""The accelerator pool as a Prefect global concurrency limit plus per-device locks."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

from lsreplay.config import PoolConfig
from lsreplay.devices import any_held, hold_devices

log = logging.getLogger(__name__)

# A holder renews its lease while it runs; if its process dies, the slots come back when
# the lease expires (the server's repossessor looks every 15 s). 60 s is the server's minimum.
LEASE_SECONDS = 60


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
def pool_devices(pool: PoolConfig, count: int = 1):
    """Hold `count` pool slots and yield the device indices they stand for."""
    with _slots(pool.name, count):
        with hold_devices(pool, count) as indices:
            yield indices


try:
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease, release_concurrency_slots_with_lease
except ImportError:  # a Prefect without these internals: the public context manager does the same
    from prefect.concurrency.sync import concurrency

    def _slots(name: str, count: int):
        return concurrency(name, occupy=count, strict=True, lease_duration=LEASE_SECONDS,
                           raise_on_lease_renewal_failure=False)
else:

    @contextmanager
    def _slots(name: str, count: int):
        """Prefect's `concurrency()` renews the lease at once from a thread and waits up to
        2 s for it on exit, on every stage; this renews only when due and exits at once."""
        lease = acquire_concurrency_slots_with_lease([name], count, lease_duration=LEASE_SECONDS, strict=True)
        stop = threading.Event()
        renewer = threading.Thread(target=_renew, args=(lease.lease_id, stop), daemon=True,
                                   name=f"lease-{name}")
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            release_concurrency_slots_with_lease(lease.lease_id)


def _renew(lease_id, stop: threading.Event) -> None:
    while not stop.wait(LEASE_SECONDS * 0.5):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(lease_id=lease_id, lease_duration=LEASE_SECONDS)
        except Exception as e:  # the next try may pass; at worst the slot is given back early
            log.warning("could not renew the pool lease %s: %s: %s", lease_id, type(e).__name__, e)
