"""The accelerator pool as a Prefect global concurrency limit plus per-device locks."""

from __future__ import annotations

from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound

from lsreplay.config import PoolConfig
from lsreplay.devices import hold_devices


def ensure_pool(pool: PoolConfig) -> None:
    """Create the pool's concurrency limit if it does not exist yet."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(pool.name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=pool.name, limit=pool.slots))


@contextmanager
def pool_devices(pool: PoolConfig, count: int = 1):
    """Hold `count` pool slots and yield the device indices they stand for."""
    with concurrency(pool.name, occupy=count, strict=True):
        with hold_devices(pool.name, pool.slots, count) as indices:
            yield indices
