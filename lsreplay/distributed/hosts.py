"""Where stages run: a host is a process that keeps state for pool devices (lsreplay.state.resident).

Under the thread runner the host is the flow's own process: every stage runs on the flow's
threads and the state of every device lives there. Under `pool.task_runner=ray` each pool
device has a long-lived Ray actor of its own (a policy update over several devices, one
for its group), created on first use and kept for the run: Prefect's tasks still run in the
flow's process, hold the pool slots, and hand each stage to the host of the devices they
hold. A host runs the very stage functions of lsreplay.stages; its process keeps the models
between stages and steps, and a host that lacks a policy takes its weights from the host
that holds them before it falls back on the store.
"""

from __future__ import annotations

import logging
import threading

import torch

from lsreplay import stages
from lsreplay.core import devices as device_pins
from lsreplay.core.config import Config
from lsreplay.core.deadline import stage_deadline
from lsreplay.core.run import Run
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT

log = logging.getLogger(__name__)

NAMESPACE = "lsreplay"
STAGE_FUNCTIONS = {"prompts": stages.sample_prompts, "trees": stages.generate_tree_shard,
                   "collect-trees": stages.collect_trees, "prefixes": stages.cache_prefixes,
                   "policy": stages.train_policy, "drafter": stages.distill_drafter, "eval": stages.evaluate_policy}


class DeviceHost:
    """Runs stages in this process, for the pool slots `indices` (pinned to this process's
    own devices when it is a Ray actor with GPUs of its own)."""

    def __init__(self, cfg: Config, indices: list[int]):
        self.name, self.pool = host_name(cfg, indices), host_name(cfg, [])
        if cfg.pool.accelerator == "cuda":  # Ray shows it its GPUs only (pool.ray_gpus > 0: core/config/validation.py)
            device_pins.check_accelerator(cfg.pool, len(indices))
            device_pins.pin(indices, [torch.device("cuda", i) for i in range(len(indices))])
        RESIDENT.peer_weights = self._peer_weights

    def run(self, stage: str, cfg: Config, step: int, **kwargs) -> dict:
        return STAGE_FUNCTIONS[stage](Run(cfg), step, **kwargs)

    def flush(self, cfg: Config) -> list[str]:
        return _flush_writer(cfg)

    def weights(self, run_id: str, step: int) -> dict[str, torch.Tensor] | None:
        """The weights of the policy acting in `step` of run `run_id`, if this host holds it (on the CPU)."""
        return RESIDENT.weights(run_id, step)

    def _peer_weights(self, run_id: str, step: int) -> dict[str, torch.Tensor] | None:
        import ray

        peers = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(self.pool) and a["name"] != self.name]
        for name in peers:  # the other hosts of this pool: single devices, and update groups
            try:
                peer = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # not created (yet)
                continue
            if (weights := ray.get(peer.weights.remote(run_id, step))) is not None:
                log.info("policy of step %d taken from host %s", step, name)
                return weights
        return None


def host_name(cfg: Config, indices: list[int]) -> str:
    return f"lsreplay-{cfg.pool.name}-{'-'.join(map(str, indices))}"


# Handles of the hosts this process created, by name: an actor lives while its owner holds
# a handle to it, and ends with its owner (no host outlives the flow that started it).
_HOSTS: dict[str, object] = {}
_HOSTS_LOCK = threading.Lock()


def ray_host(cfg: Config, indices: list[int]):
    """The Ray actor hosting pool slots `indices`: created on first use, with their GPUs;
    several threads, so that it answers its peers' requests for weights while it runs a stage."""
    import ray

    name = host_name(cfg, indices)
    with _HOSTS_LOCK:
        if name not in _HOSTS:
            _HOSTS[name] = ray.remote(DeviceHost).options(
                name=name, namespace=NAMESPACE, num_gpus=cfg.pool.ray_gpus * len(indices), max_concurrency=4,
            ).remote(cfg, indices)
        return _HOSTS[name]


def run_on_host(stage: str, cfg: Config, step: int, devices: list[int], **kwargs) -> dict:
    """Run stage `stage` for the pool slots `devices`: here (thread runner) or on their Ray host."""
    if cfg.pool.task_runner != "ray":
        with stage_deadline(cfg, stage, step):
            return STAGE_FUNCTIONS[stage](Run(cfg), step, devices=devices, **kwargs)
    import ray

    host = ray_host(cfg, devices)
    try:
        return ray.get(host.run.remote(stage, cfg, step, devices=devices, **kwargs),
                       timeout=cfg.pool.stage_timeout_seconds or None)
    except ray.exceptions.GetTimeoutError:
        # The host goes on with the stage, which a retry must not meet there: it goes, with its state.
        _kill_host(cfg, devices)
        raise TimeoutError(f"stage {stage} of step {step} ran past pool.stage_timeout_seconds="
                           f"{cfg.pool.stage_timeout_seconds:g} on Ray host {host_name(cfg, devices)}; the host was "
                           "ended (a retry starts a new one)") from None


def flush_writers(cfg: Config) -> list[str]:
    """Wait until every host of the run has written the checkpoints it took (a policy update
    writes its checkpoint in its host's process: this one, or a Ray actor); returns the
    writes of the run that failed."""
    if cfg.pool.task_runner != "ray":
        return _flush_writer(cfg)
    import ray

    with _HOSTS_LOCK:
        hosts = [h for n, h in _HOSTS.items() if n.startswith(host_name(cfg, []))]
    return [failure for found in ray.get([h.flush.remote(cfg) for h in hosts]) for failure in found]


def _flush_writer(cfg: Config) -> list[str]:
    """Wait for this process's checkpoint writer; the failed writes of the run of `cfg`."""
    checkpointing.WRITER.wait()
    return checkpointing.WRITER.failed(Run(cfg))


def release_hosts(cfg: Config) -> None:
    """End the pool's Ray hosts (their state goes with them), each once its checkpoint writer
    is done: killed in the middle of a write, it would leave the checkpoint incomplete. Nothing
    to do in-process."""
    if cfg.pool.task_runner != "ray":
        return
    import ray

    try:
        flush_writers(cfg)
    except Exception as e:  # a host that died has nothing left to write
        log.warning("could not wait for the Ray hosts' checkpoint writers: %s: %s", type(e).__name__, e)
    with _HOSTS_LOCK:
        for name in [n for n in _HOSTS if n.startswith(host_name(cfg, []))]:
            ray.kill(_HOSTS.pop(name))


def _kill_host(cfg: Config, indices: list[int]) -> None:
    import ray

    with _HOSTS_LOCK:
        if (host := _HOSTS.pop(host_name(cfg, indices), None)) is not None:
            ray.kill(host)
