"""Stage 4: the policy update. GRPO weights from the caching pass's logprobs, branch
replay (or the per-rollout baseline) backward, clip, AdamW step, checkpoint."""

from __future__ import annotations

import math
import time

import torch

from lsreplay import checkpointing, faults
from lsreplay.algos import loss_and_weights
from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.kl import kl_loss, with_kl
from lsreplay.devices import cuda_determinism
from lsreplay.metrics import clip_fractions
from lsreplay.replay import naive_backward, replay_backward
from lsreplay.replay.capture import TreeActivations
from lsreplay.resident import RESIDENT
from lsreplay.run import Run
from lsreplay.stages.common import StateClock, leaf_counts, leaf_subtrees, load_trees
from lsreplay.stages.prefixes import StoredPrefixKV, load_activations
from lsreplay.train_state import TrainState, local, master_dtype


class NonFiniteLoss(FloatingPointError):
    """A step whose loss or gradient is NaN/inf; it is never checkpointed."""


def grpo_weights(run: Run, step: int, records, trees, prefixes: dict):
    """Loss value and dL/dlogp per completion token, at ratio 1: one update per batch starts
    from the parameters the caching pass scored with. So old logprobs are the caching pass's
    where the KL term needs their values, and zeros (any value gives the same loss and
    weights) where it did not score them."""
    algo = run.cfg.algo
    acts = ([load_activations(run, step, i, prefixes) for i in range(len(trees))] if algo.kl_coef > 0 or algo.tis_cap
            else [TreeActivations()] * len(trees))  # the drafter's hidden states are not read here
    old = [t.completion_values(torch.zeros(t.num_entries, dtype=torch.float64) if a.entry_logprobs is None
                               else a.entry_logprobs) for t, a in zip(trees, acts)]
    max_tokens = run.cfg.rollout.max_new_tokens
    counts = [leaf_counts(r) for r in records]  # every leaf counts as the samples it stands for
    advantages = [group_advantages(torch.tensor(r["rewards"]), algo.scale_rewards, counts=n,
                                   subtrees=leaf_subtrees(r) if algo.tree_baseline == "independent" else None)
                  for r, n in zip(records, counts)]
    if algo.tis_cap:
        advantages = [importance_weighted(a, o, r["logprobs"], algo.tis_cap) for a, o, r in zip(advantages, old, records)]
    batch = GRPOBatch(advantages=advantages, old_logprobs=old, clip_eps=algo.clip_eps, loss_agg=algo.loss_agg,
                      max_tokens=max_tokens, counts=counts)
    # One update per batch: the loss is evaluated at the old logprobs (ratio 1).
    loss_fn, extras = (lambda lp: grpo_loss(lp, batch)), clip_fractions(old, old, advantages, algo.clip_eps)
    if algo.kl_coef > 0:
        ref = [t.completion_values(a.ref_entry_logprobs) for t, a in zip(trees, acts)]
        loss_fn = with_kl(loss_fn, ref, algo.kl_coef, algo.kl_estimator, algo.loss_agg, max_tokens, counts)
        extras["kl"] = float(kl_loss(old, ref, algo.kl_estimator, algo.loss_agg, max_tokens, counts))
    return *loss_and_weights(loss_fn, old), extras


def importance_weighted(advantages: torch.Tensor, trainer: list[torch.Tensor], engine: list[list[float]],
                        cap: float) -> list[torch.Tensor]:
    """Truncated importance sampling (algo.tis_cap): each token's advantage times
    min(p_trainer / p_engine, cap) of the token, correcting for the rollout engine sampling
    from slightly other probabilities than the trainer computes (vLLM's kernels, bf16)."""
    return [a * torch.exp(t - torch.tensor(e, dtype=torch.float64)).clamp(max=cap)
            for a, t, e in zip(advantages, trainer, engine)]


def train_policy(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool's device indices this stage holds (one per data-parallel rank,
    `pool.devices_per_step` of them). One rank updates the policy this process holds for
    that device in place (lsreplay.resident); several run on `lsreplay.parallel.launch`ed
    processes (gloo on CPU; rank r on the r-th device held) over state shared with this one."""
    if done := run.done(step, "policy"):
        return done
    run.begin(step, "policy")
    records, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    loss, weights, extras = grpo_weights(run, step, records, trees, prefixes)
    loss = faults.loss("policy", step, loss)
    start = time.perf_counter()
    if run.cfg.pool.devices_per_step > 1:
        out = _data_parallel_update(run, step, weights, loss, devices)
    else:
        out = _update(run, step, trees, weights, loss, prefixes, run.device(devices))
    return run.finish(step, "policy", {**out, "loss": loss, "seconds": time.perf_counter() - start, **extras})


def _update(run: Run, step: int, trees, weights, loss: float, prefixes: dict, device: torch.device) -> dict:
    """Backward, clip, AdamW step on the held state of `device`, checkpoint if due."""
    clock = StateClock()
    train = clock(RESIDENT.train_state, run, step, device)
    train.zero_grad()
    if run.cfg.replay.mode == "replay":
        stats = replay_backward(train.model, trees, weights, prefix_kv=StoredPrefixKV(run, prefixes, device),
                                budget_bytes=run.cfg.replay.budget_mb * 2**20 or None,
                                join_below=run.cfg.replay.join_below)
    else:
        stats = naive_backward(train.model, trees, weights)
    grad_norm = _commit_step(run, step, train, loss, lambda: RESIDENT.drop(run, device))
    RESIDENT.updated(run, step, device)
    saved = clock(checkpointing.save, run, step, train)
    faults.hook("policy", step, "mid")  # updated in memory, the checkpoint maybe half written, no done marker
    return {"checkpoint": saved["checkpoint"], "grad_norm": grad_norm, "device": str(device),
            "learning_rate": train.optimizer.param_groups[0]["lr"], "state_seconds": clock.seconds,
            **_stats_fields(stats)}


def _stats_fields(stats) -> dict:
    return {"objective": stats.objective, "positions": stats.positions,
            "per_rollout_positions": stats.per_rollout_positions, "positions_ratio": stats.positions_ratio,
            "peak_activation_bytes": stats.peak_activation_bytes, "device_peak_bytes": stats.device_peak_bytes,
            "backward_seconds": stats.seconds}


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
# The ranks are processes of their own (lsreplay.parallel.launch) started for the update;
# the state they update is this process's, put in shared memory (TrainState.shared): each
# rank reads the masters and AdamW moments from there and writes back what it updated,
# plain DP rank 0 all of it, FSDP every rank its own rows. Nothing is gathered and nothing
# goes through the store; this process then checkpoints on its schedule. The state of the
# group lives in host memory, under the CPU in lsreplay.resident.
def _data_parallel_update(run: Run, step: int, weights, loss: float, devices) -> dict:
    from lsreplay.parallel import launch

    world = run.cfg.pool.devices_per_step
    devices = list(devices) if devices is not None else list(range(world))
    if len(devices) < world:
        raise ValueError(f"pool.devices_per_step = {world} ranks but the stage holds {len(devices)} devices")
    clock, host = StateClock(), torch.device("cpu")
    train = clock(RESIDENT.train_state, run, step, host)
    shared = clock(train.shared)
    backend = "nccl" if run.cfg.pool.accelerator == "cuda" else "gloo"
    rank_devices = [str(run.device([index])) for index in devices[:world]]
    outs = launch(_rank_update, world_size=world, args=(run.cfg, step, weights, loss, rank_devices, shared),
                  backend=backend, threads=max(1, run.cfg.threads // world))
    if "nonfinite" in outs[0]:  # no rank wrote anything back
        raise NonFiniteLoss(outs[0]["nonfinite"])
    train.follow_masters()
    RESIDENT.updated(run, step, host)
    saved = clock(checkpointing.save, run, step, train)
    faults.hook("policy", step, "mid")
    return {**outs[0], "checkpoint": saved["checkpoint"], "state_seconds": clock.seconds}


def _rank_update(rank: int, world: int, cfg, step: int, weights, loss: float, devices: list[str],
                 shared: dict) -> dict | None:
    """One data-parallel rank, on devices[rank]: its share of the trees' backward, gradients
    summed over ranks; then plain DP: rank 0 clips and steps; FSDP: every rank steps its shard."""
    from lsreplay.models import load_model
    from lsreplay.parallel import data_parallel_backward, shard_model

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
    model = load_model(cfg.model, device=device, dtype=masters if fsdp else None)
    if fsdp:
        model.load_state_dict(shared["masters"], strict=False)
        mixed = masters != cfg.model.dtype
        shard_model(model, param_dtype=getattr(torch, cfg.model.dtype) if mixed else None,
                    reduce_dtype=getattr(torch, masters) if mixed else None)
    train = TrainState(model, cfg.optim)
    if not fsdp:
        train.load_masters(shared["masters"])
    stats = data_parallel_backward(model, trees, weights, rank, world, mode=cfg.replay.mode, fsdp=fsdp,
                                   prefix_kv=StoredPrefixKV(run, prefixes, device),
                                   budget_bytes=cfg.replay.budget_mb * 2**20 or None,
                                   join_below=cfg.replay.join_below, grad_params=train.masters)
    try:
        if fsdp or rank == 0:
            _load_moments(train, shared, rank, world)
            grad_norm = _commit_step(run, step, train, loss, lambda: None, sharded=fsdp)
            _write_back(train, shared, rank, world)
    except NonFiniteLoss as e:  # travels back as a value: a rank's exception would lose its type
        return {"nonfinite": str(e)}
    if rank != 0:
        return None
    return {"grad_norm": grad_norm, "device": str(device), "ranks": world,
            "learning_rate": train.optimizer.param_groups[0]["lr"], **_stats_fields(stats)}


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
