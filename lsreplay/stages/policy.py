"""Stage 4: the policy update. The objective of the configured algorithm over the caching
pass's scores (lsreplay.stages.objectives), branch replay (or the per-rollout baseline)
backward, clip, AdamW step at the scheduled learning rate (several with PPO), checkpoint."""

from __future__ import annotations

import logging
import math
import time
from functools import partial

import torch

from lsreplay.state import checkpointing

from lsreplay.algos import loss_and_weights
from lsreplay.algos.updates import Minibatch, minibatch_updates
from lsreplay.core import faults
from lsreplay.core.devices import cuda_determinism
from lsreplay.core.run import Run
from lsreplay.models.train_state import TrainState, local, master_dtype
from lsreplay.stages.common import StateClock, all_alike, left_out, load_trees, policy_heads, training_rewards
from lsreplay.stages.objectives import Objective, objective, updates_per_step
from lsreplay.stages.prefixes import StoredPrefixKV, capture_now
from lsreplay.stages.versions import too_stale
from lsreplay.state.resident import RESIDENT, policy_model, policy_train_state

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    """A step whose loss or gradient is NaN/inf; it is never checkpointed."""


def train_policy(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool's device indices this stage holds (one per data-parallel rank,
    `pool.devices_per_step` of them). One rank updates the policy this process holds for
    that device in place (lsreplay.state.resident); several run on `lsreplay.distributed.parallel.launch`ed
    processes (gloo on CPU; rank r on the r-th device held) over state shared with this one."""
    if done := run.done(step, "policy"):
        return done
    run.begin(step, "policy")
    records, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    goal = objective(run, step, records, trees, prefixes)
    start = time.perf_counter()
    if run.cfg.pool.devices_per_step > 1:
        out = _data_parallel_update(run, step, goal, devices)
    else:
        out = _update(run, step, trees, goal, prefixes, run.device(devices))
    if not out["positions"]:
        _trains_nothing(run.cfg, step, records)
    return run.finish(step, "policy", {**out, "devices": devices, "seconds": time.perf_counter() - start,
                                       **goal.extras})


def _trains_nothing(cfg, step: int, records: list[dict]) -> None:
    """Say why a step's update had no nonzero loss weight (it still steps AdamW's moments)."""
    alike = sum(all_alike(training_rewards(cfg, r)) for r in records)
    why = [f"{alike} of {len(records)} trees have leaves that all got the same reward"
           + ("" if cfg.algo.dynamic_sampling else " (algo.dynamic_sampling=true replaces them by other prompts)")]
    if stale := sum(map(partial(too_stale, cfg), records)):
        why.append(f"{stale} trees were older than rollout.max_staleness allows, and dropped")
    if out := sum(left_out(cfg, records)) - stale:
        why.append(f"dynamic sampling left {out} trees out of the loss (all alike on "
                   f"{cfg.algo.dynamic_sampling_metric} after algo.dynamic_sampling_draws rounds)")
    if cfg.algo.overlong == "mask":
        cut = sum(not f for r in records for f in r["finished"])
        why.append(f"algo.overlong=mask left {cut} of {sum(len(r['finished']) for r in records)} answers out")
    log.warning("step %d trains nothing: no loss weight is nonzero; %s", step, "; ".join(why))


def _update(run: Run, step: int, trees, goal: Objective, prefixes: dict, device: torch.device) -> dict:
    """The objective's minibatches on the held state of `device`: backward, clip, AdamW
    step each; checkpoint if due."""
    clock, cfg = StateClock(), run.cfg
    train = clock(RESIDENT.train_state, run, step, device)
    train.zero_grad()
    per_step, norms, figures = updates_per_step(cfg), [], []

    def take_step(m: Minibatch) -> None:
        train.schedule(step * per_step + m.index, cfg.steps * per_step)
        RESIDENT.updating(run, device)  # usable again only once `updated` (below) says which step it acts in
        norms.append(_commit_step(run, step, train, faults.loss("policy", step, m.loss),
                                  lambda: RESIDENT.drop(run, device)))
        figures.append(goal.figures(m.trees, m.scores))
        train.zero_grad()

    replay = cfg.replay.mode == "replay"
    try:
        done = minibatch_updates(
            train.model, trees, goal.loss_for, goal.orders, take_step, cfg.replay.mode, heads=goal.heads,
            first=(goal.old, StoredPrefixKV(run, prefixes, device) if replay else None),
            budget_bytes=cfg.replay.budget_mb * 2**20 or None, join_below=cfg.replay.join_below,
            offload_prefix=cfg.replay.offload_prefix,
            capture=lambda sub: capture_now(run, train.model, sub, goal.heads))
    except BaseException:
        if norms:  # the held state is part of the way through the update: unusable
            RESIDENT.drop(run, device)
        raise
    RESIDENT.updated(run, step, device)
    saved = clock(checkpointing.save, run, step, train)
    faults.hook("policy", step, "mid")  # updated in memory, the checkpoint maybe half written, no done marker
    return {"checkpoint": saved["checkpoint"], "grad_norm": sum(norms) / len(norms), "device": str(device),
            "state_seconds": clock.seconds, "loss": sum(m.loss for m in done) / len(done), "updates": len(done),
            "learning_rate": train.optimizer.param_groups[0]["lr"], **_mean(figures), **_stats_fields([m.stats for m in done])}


def _mean(figures: list[dict]) -> dict:
    """Each figure's mean over the minibatches that have it."""
    keys = {k for f in figures for k in f}
    return {k: sum(f[k] for f in figures if k in f) / sum(k in f for f in figures) for k in sorted(keys)}


def _stats_fields(stats: list) -> dict:
    """The backward's figures over an update's minibatches: summed, the peaks their max."""
    positions, per_rollout = sum(s.positions for s in stats), sum(s.per_rollout_positions for s in stats)
    peaks = [s.device_peak_bytes for s in stats if s.device_peak_bytes is not None]
    return {"objective": sum(s.objective for s in stats), "positions": positions,
            "per_rollout_positions": per_rollout, "positions_ratio": per_rollout / max(positions, 1),
            "peak_activation_bytes": max(s.peak_activation_bytes for s in stats),
            "device_peak_bytes": max(peaks) if peaks else None, "backward_seconds": sum(s.seconds for s in stats),
            "layer_by_layer_positions": sum(s.layer_by_layer_positions for s in stats)}


def _commit_step(run: Run, step: int, train: TrainState, loss: float, forget, sharded: bool = False) -> float:
    """Clip, check, AdamW step, check; raises NonFiniteLoss, with nothing committed: a
    non-finite gradient is caught before the step, and state the step made non-finite is
    forgotten (`forget`), so the last good checkpoint is what the run resumes from.
    sharded: every rank holds a shard (FSDP), so the checks agree over ranks."""
    grad_norm = train.clip_grad_norm()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"step {step}: loss={loss} grad_norm={grad_norm}; the step was not committed "
                            "(the last good checkpoint is kept). Lower optim.lr or check the rewards.")
    try:
        train.step()
    except BaseException:
        forget()
        raise
    faults.hook("policy", step, "stepped")  # stepped, not yet recorded: where a timeout may strike
    bad = train.nonfinite()
    if _any_rank(bool(bad)) if sharded else bad:
        forget()
        raise NonFiniteLoss(f"step {step}: the optimizer step made {len(bad)} parameters non-finite "
                            f"({bad[0] if bad else 'on another rank'}, ...); the step was not committed "
                            "(the last good checkpoint is kept). Lower optim.lr.")
    return grad_norm


def _any_rank(flag: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([float(flag)])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# -- data parallel -----------------------------------------------------------------------
# The ranks are processes of their own (lsreplay.distributed.parallel.launch) started for the update;
# the state they update is this process's, put in shared memory (TrainState.shared): each
# rank reads the masters and AdamW moments from there and writes back what it updated,
# plain DP rank 0 all of it, FSDP every rank its own rows. Nothing is gathered and nothing
# goes through the store; this process then checkpoints on its schedule. The state of the
# group lives in host memory, under the CPU in lsreplay.state.resident.
def _data_parallel_update(run: Run, step: int, goal: Objective, devices) -> dict:
    """One update (config validation: PPO's several need one device): the loss's weights over
    all trees here, every rank's share of the backward there."""
    from lsreplay.distributed.parallel import launch

    loss, weights = loss_and_weights(goal.loss_for(goal.orders[0][0]), goal.old)
    loss = faults.loss("policy", step, loss)

    world = run.cfg.pool.devices_per_step
    devices = list(devices) if devices is not None else list(range(world))
    if len(devices) < world:
        raise ValueError(f"pool.devices_per_step = {world} ranks but the stage holds {len(devices)} devices")
    clock, host = StateClock(), torch.device("cpu")
    train = clock(RESIDENT.train_state, run, step, host)
    shared = clock(train.shared)
    backend = "nccl" if run.cfg.pool.accelerator == "cuda" else "gloo"
    rank_devices = [str(run.device([index])) for index in devices[:world]]
    doomed = faults.doomed_rank("policy", step, world)
    RESIDENT.updating(run, host)  # the ranks write the stepped state back into this copy's
    outs = launch(_rank_update, world_size=world, args=(run.cfg, step, weights, loss, rank_devices, shared, doomed),
                  backend=backend, threads=max(1, run.cfg.threads // world))
    if "nonfinite" in outs[0]:  # no rank wrote anything back
        raise NonFiniteLoss(outs[0]["nonfinite"])
    train.follow_masters()
    train.schedule(step, run.cfg.steps)  # the rate rank 0 stepped with, as the checkpoint records it
    RESIDENT.updated(run, step, host)
    saved = clock(checkpointing.save, run, step, train)
    faults.hook("policy", step, "mid")
    figures = goal.figures(goal.orders[0][0], goal.old)
    return {**outs[0], "checkpoint": saved["checkpoint"], "state_seconds": clock.seconds, "loss": loss, "updates": 1,
            "learning_rate": train.optimizer.param_groups[0]["lr"], **figures}


def _rank_update(rank: int, world: int, cfg, step: int, weights, loss: float, devices: list[str],
                 shared: dict, doomed: int | None = None) -> dict | None:
    """One data-parallel rank, on devices[rank]: its share of the trees' backward (with
    replay.context_parallel, its share of the prompts split over its group too), gradients
    summed over ranks; then plain DP: rank 0 clips and steps; FSDP: every rank steps its shard."""
    from lsreplay.distributed.parallel import data_parallel_backward, shard_model

    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        cuda_determinism(cfg.pool)  # a process of its own: Run.begin set it in the stage's only
    run = Run(cfg)
    _, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    fsdp = bool(cfg.replay.fsdp)
    # FSDP keeps float32 shards as masters and computes in model.dtype (its mixed-precision
    # policy); plain DP computes in model.dtype with float32 masters (TrainState).
    masters = master_dtype(cfg.model.dtype)
    model = policy_model(cfg, device, dtype=masters if fsdp else None)
    if fsdp:
        model.load_state_dict(shared["masters"], strict=False)
        mixed = masters != cfg.model.dtype
        shard_model(model, param_dtype=getattr(torch, cfg.model.dtype) if mixed else None,
                    reduce_dtype=getattr(torch, masters) if mixed else None)
    train = policy_train_state(cfg, model)
    if not fsdp:
        train.load_masters(shared["masters"])
    if rank == doomed:
        faults.kill_this_rank()
    stats = data_parallel_backward(model, trees, weights, rank, world, mode=cfg.replay.mode, fsdp=fsdp,
                                   prefix_kv=StoredPrefixKV(run, prefixes, device),
                                   budget_bytes=cfg.replay.budget_mb * 2**20 or None,
                                   join_below=cfg.replay.join_below, offload_prefix=cfg.replay.offload_prefix,
                                   grad_params=train.masters, heads=policy_heads(cfg),
                                   context_parallel=cfg.replay.context_parallel,
                                   context_threshold=cfg.replay.context_parallel_tokens)
    try:
        if fsdp or rank == 0:
            _load_moments(train, shared, rank, world)
            train.schedule(step, cfg.steps)  # one update per step here
            grad_norm = _commit_step(run, step, train, loss, lambda: None, sharded=fsdp)
            _write_back(train, shared, rank, world)
    except NonFiniteLoss as e:  # travels back as a value: a rank's exception would lose its type
        return {"nonfinite": str(e)}
    if rank != 0:
        return None
    return {"grad_norm": grad_norm, "device": str(device), "ranks": world, **_stats_fields([stats])}


def _rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rows of `full` a rank's FSDP shard holds (FSDP2 shards dim 0 as torch.chunk does)."""
    chunks = full.chunk(world, dim=0) if full.dim() else [full]
    return chunks[rank] if rank < len(chunks) else full[:0]


def _load_moments(train: TrainState, shared: dict, rank: int, world: int) -> None:
    """AdamW moments from the shared state into this rank's optimizer (its rows, if sharded)."""
    from torch.distributed.tensor import DTensor

    for master, moments in zip(train.masters, shared["optimizer"]):
        state = train.optimizer.state[master]
        for name, full in moments.items():
            if name == "step":  # on the host, as AdamW keeps it: on a GPU, each step would read it back
                state[name] = full.clone()
            elif not hasattr(master, "to_local"):
                state[name] = full.to(local(master).device, copy=True)
            else:
                rows = _rows(full, rank, world).to(master.to_local().device, copy=True)
                state[name] = DTensor.from_local(rows, master.device_mesh, master.placements, run_check=False,
                                                 shape=master.shape, stride=master.stride())


def _write_back(train: TrainState, shared: dict, rank: int, world: int) -> None:
    """This rank's updated masters and moments into the shared state: all of them, or its rows."""
    with torch.no_grad():
        for name, master, moments in zip(train.names, train.masters, shared["optimizer"]):
            sharded = hasattr(master, "to_local")
            target = _rows(shared["masters"][name], rank, world) if sharded else shared["masters"][name]
            target.copy_(local(master))
            for key, full in moments.items():
                value = local(train.optimizer.state[master][key])
                if key == "step" or not sharded:
                    if rank == 0:
                        full.copy_(value)
                else:
                    _rows(full, rank, world).copy_(value)
