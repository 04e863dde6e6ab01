"""The accelerator pool: a Prefect global concurrency limit plus per-device locks. Concurrent
holders never share a device; slots come back after failures."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from lsreplay.core.config import PoolConfig

REPO = Path(__file__).resolve().parents[1]


def active_slots(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_pool_gives_each_holder_its_own_device_and_releases_after_failures(prefect_server, short_handoff):
    from prefect import flow, task

    from tasks.pool import ensure_pool, pool_devices

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=2)
    ensure_pool(PoolConfig(name=pool.name, slots=5))
    ensure_pool(pool)  # an existing limit takes the configured size
    spans: list[tuple[int, float, float]] = []
    lock = threading.Lock()

    @task
    def hold(seconds: float, fail: bool = False) -> int:
        with pool_devices(pool) as (device,):
            start = time.monotonic()
            time.sleep(seconds)
            end = time.monotonic()
            with lock:
                spans.append((device, start, end))
            if fail:
                raise RuntimeError("a stage failing on its device")
            return device

    @flow
    def busy() -> list[bool]:
        futures = [hold.submit(0.4, fail=i % 3 == 1) for i in range(6)]
        for f in futures:
            f.wait()
        return [f.state.is_failed() for f in futures]

    assert sorted(busy()) == [False] * 4 + [True] * 2
    assert len(spans) == 6 and {d for d, _, _ in spans} == {0, 1}
    for i, (d1, s1, e1) in enumerate(spans):
        for d2, s2, e2 in spans[i + 1:]:
            assert d1 != d2 or e1 <= s2 or e2 <= s1, f"device {d1} held twice at once: {spans}"
    # Never more than two at once, and at some point two at once.
    events = sorted([(s, 1) for _, s, _ in spans] + [(e, -1) for _, _, e in spans])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    assert peak == 2
    # The failed holders gave their slots back; the last ones left theirs for a next holder,
    # for HANDOFF_SECONDS at most.
    assert slots_come_back(pool.name)

    @flow
    def after() -> list:
        return [f.result() for f in [hold.submit(0.05) for _ in range(3)]]

    assert sorted(after()) and slots_come_back(pool.name)


@pytest.fixture
def short_handoff(monkeypatch):
    """Holdings left unused go back after 1 s instead of HANDOFF_SECONDS (5 s), which the
    checks that they do go back would otherwise wait out."""
    import tasks.pool

    monkeypatch.setattr(tasks.pool, "HANDOFF_SECONDS", 1.0)


def slots_come_back(name: str) -> bool:
    from tasks.pool import HANDOFF_SECONDS

    deadline = time.monotonic() + HANDOFF_SECONDS + 10
    while active_slots(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    return active_slots(name) == 0


def test_a_holder_hands_its_slots_and_devices_to_the_next_one_in_its_process(prefect_server, monkeypatch,
                                                                             short_handoff):
    import tasks.pool
    from lsreplay.core.devices import any_held
    from tasks.pool import ensure_pool, pool_devices, release_parked

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=2)
    ensure_pool(pool)
    asked: list[int] = []  # the slot counts asked of the server
    server_slots = tasks.pool._slots
    monkeypatch.setattr(tasks.pool, "_slots", lambda name, count: asked.append(count) or server_slots(name, count))

    with pool_devices(pool) as (first,):
        pass
    assert active_slots(pool.name) == 1 and any_held(pool, 2)  # left for the next stage
    with pool_devices(pool) as (second,):
        assert second == first and active_slots(pool.name) == 1
    assert asked == [1]
    # Two wanted: the one left is not enough, so it goes back and two are asked for.
    with pool_devices(pool, 2) as devices:
        assert sorted(devices) == [0, 1] and active_slots(pool.name) == 2
    assert asked == [1, 2]
    # A holder that fails gives its slots back at once (a failed stage's device may be unusable).
    with pytest.raises(RuntimeError), pool_devices(pool):
        raise RuntimeError("a stage failing on its device")
    assert asked == [1, 2, 1] and active_slots(pool.name) == 0 and not any_held(pool, 2)
    # A run's end gives back what its last stage left; a forked child finds none of it to take.
    with pool_devices(pool):
        pass
    if (child := os.fork()) == 0:
        os._exit(0 if tasks.pool.HANDOFF.take(pool, 1) is None else 3)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    release_parked()
    assert active_slots(pool.name) == 0 and not any_held(pool, 2)
    # Left unused, they go back after HANDOFF_SECONDS.
    with pool_devices(pool):
        pass
    assert active_slots(pool.name) == 1 and slots_come_back(pool.name) and not any_held(pool, 2)


def test_a_holder_of_given_devices_gets_those_waiting_while_another_has_them(prefect_server):
    from tasks.pool import ensure_pool, pool_devices, release_parked

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=2)
    ensure_pool(pool)
    with pool_devices(pool) as (first,):
        pass
    # The parked one is not among those asked for: it stays for its own next stage (the
    # update's, while rollouts hold pool.rollout_devices of their own).
    with pool_devices(pool, on=[1 - first]) as devices:
        assert devices == [1 - first] and active_slots(pool.name) == 2
    order: list[str] = []

    def other_holder() -> None:
        with pool_devices(pool, on=[first]):
            order.append("held")
            time.sleep(1.5)
            order.append("giving back")

    holder = threading.Thread(target=other_holder)
    holder.start()
    while not order:
        time.sleep(0.05)
    with pool_devices(pool, on=[first]) as devices:  # device 1 - first is free, but not the one asked for
        order.append("taken")
    holder.join()
    assert devices == [first] and order == ["held", "giving back", "taken"]
    release_parked()
    assert active_slots(pool.name) == 0


def test_prefect_yaml_deploys_the_training_flow():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployment = spec["deployments"][0]
    path, name = deployment["entrypoint"].split(":")
    assert (REPO / path).is_file() and name == "train"
    assert deployment["work_pool"]["name"]
    assert "secret" not in yaml.safe_dump(deployment["parameters"]).lower()


@pytest.mark.parametrize("argv", [["serve", "--cron", "0 3 * * *", "--interval", "60"], ["serve"]])
def test_serve_needs_one_schedule(argv):
    from lsreplay import cli

    with pytest.raises(SystemExit):
        cli.main(argv)


def test_slots_stranded_by_a_killed_run_are_freed_only_with_no_live_holder(prefect_server):
    from prefect.client.orchestration import get_client

    from lsreplay.core.devices import hold_devices
    from tasks.pool import ensure_pool, free_stranded_slots

    pool = PoolConfig(name=f"test-pool-{uuid.uuid4().hex[:8]}", slots=2)
    ensure_pool(pool)
    with get_client(sync_client=True) as client:  # what a run killed mid-stage leaves behind
        client.increment_concurrency_slots([pool.name], slots=2, mode="concurrency")
    assert active_slots(pool.name) == 2
    with hold_devices(pool, 1):  # a live holder: nothing is taken from it
        assert free_stranded_slots(pool) == 0 and active_slots(pool.name) == 2
    assert free_stranded_slots(pool) == 2 and active_slots(pool.name) == 0
    assert free_stranded_slots(pool) == 0


def test_idle_cpu_work_runs_at_the_lowest_priority_and_hands_back_its_result_or_error():
    import os

    from lsreplay.core.devices import on_idle_cpu

    def policy() -> int:
        return os.sched_getscheduler(threading.get_native_id())

    before = policy()
    assert on_idle_cpu(policy) == os.SCHED_IDLE != before
    with pytest.raises(KeyError, match="missing"):
        on_idle_cpu(lambda: {}["missing"])
    assert policy() == before  # the caller's thread keeps its policy


def test_the_drafter_yields_the_cpu_only_where_it_overlaps_rollouts(tmp_path):
    """At idle priority on a CPU slot while the next step's rollouts run; at normal priority
    at the last step (no rollouts after it, and the run waits for it), on the update's slot
    (pool.rollout_devices) and on an accelerator."""
    import torch

    from lsreplay.core.config import load_config
    from lsreplay.core.run import Run
    from lsreplay.stages.drafter import at_idle_priority

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    run = Run(load_config(None, [f"run_dir={tmp_path}", "steps=3"]))
    assert [at_idle_priority(run, step, cpu) for step in range(3)] == [True, True, False]
    assert not at_idle_priority(run, 0, cuda)
    apart = Run(load_config(None, [f"run_dir={tmp_path}", "steps=3", "pool.slots=2", "pool.rollout_devices=[1]"]))
    assert not at_idle_priority(apart, 0, cpu)


def test_a_gpu_pool_under_ray_locks_its_slots_in_a_flow_process_that_sees_no_gpu(tmp_path, monkeypatch):
    """Under pool.task_runner=ray the flow's process holds slots and computes on no GPU (it
    may see none, or fewer than the pool has): its locks stand for pool slots, not GPU
    UUIDs, and Ray hosts check their own GPUs. This CPU machine is such a driver."""
    import torch

    from lsreplay.core.config import ConfigError, load_config
    from lsreplay.core.devices import LOCK_DIR_ENV, any_held, hold_devices
    from lsreplay.distributed.hosts import DeviceHost

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    assert not torch.cuda.is_available()
    cfg = load_config(None, ["pool.accelerator=cuda", "pool.task_runner=ray", "pool.ray_gpus=1", "pool.slots=4",
                             f"pool.name=ray-{uuid.uuid4().hex[:8]}"])
    with hold_devices(cfg.pool, 3) as held:
        assert held == [0, 1, 2] and any_held(cfg.pool, 4)
    assert not any_held(cfg.pool, 4)
    with pytest.raises(ConfigError, match=r"Ray host of 2 pool device\(s\) sees no CUDA device"):
        DeviceHost(cfg, [0, 1])


def test_a_gpu_pool_under_ray_asks_ray_for_gpus():
    """Ray hides every GPU from an actor that asks for none: ray_gpus=0 on a GPU pool is a
    config error (it was accepted, and every stage then found no CUDA device)."""
    from lsreplay.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"pool.ray_gpus.*> 0 with pool.accelerator=cuda.*pool.ray_gpus=1"):
        load_config(None, ["pool.accelerator=cuda", "pool.task_runner=ray"])
    assert load_config(None, ["pool.task_runner=ray"]).pool.ray_gpus == 0  # a CPU pool asks for none


@pytest.mark.parametrize("strict", [False, True])
def test_a_stage_on_a_gpu_pool_computes_deterministically(tmp_path, monkeypatch, strict):
    """Run.begin, at every stage's start, sets how the process computes on a GPU pool (the
    switches are torch's own, set here on a CPU): cuBLAS on a fixed workspace always, and
    with pool.deterministic every op deterministic, without torch's debugging fill of new
    tensors (docs/gpu.md)."""
    import torch

    from lsreplay.core.config import load_config
    from lsreplay.core.devices import CUBLAS_WORKSPACE
    from lsreplay.core.run import Run

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded as it was: put back after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    cfg = load_config(None, [f"run_dir={tmp_path}", "pool.accelerator=cuda", f"pool.deterministic={strict}"])
    try:
        Run(load_config(None, [f"run_dir={tmp_path}"])).begin(0, "prompts")  # a CPU pool: untouched
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        Run(cfg).begin(0, "prompts")
        assert torch.are_deterministic_algorithms_enabled() is strict
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
