"""Stage 4: the policy update. GRPO weights from the caching pass's logprobs, branch
replay (or the per-rollout baseline) backward, clip, AdamW step, checkpoint."""

from __future__ import annotations

import math
import time

import torch

from lsreplay import faults
from lsreplay.algos import loss_and_weights
from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.kl import kl_loss, with_kl
from lsreplay.checkpoint import load_optimizer, save_module, save_optimizer, save_rng
from lsreplay.models import load_model
from lsreplay.replay import naive_backward, replay_backward
from lsreplay.run import Run
from lsreplay.stages.common import load_trees, policy_before
from lsreplay.stages.prefixes import StoredPrefixKV, load_activations


class NonFiniteLoss(FloatingPointError):
    """A step whose loss or gradient is NaN/inf; it is never checkpointed."""


def make_optimizer(run: Run, model) -> torch.optim.Optimizer:
    o = run.cfg.optim
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)


def grpo_weights(run: Run, step: int, records, trees, prefixes: dict):
    """Loss value and dL/dlogp per completion token, at the caching pass's logprobs."""
    acts = [load_activations(run, step, i, prefixes) for i in range(len(trees))]
    old = [t.completion_values(a.entry_logprobs) for t, a in zip(trees, acts)]
    algo, max_tokens = run.cfg.algo, run.cfg.rollout.max_new_tokens
    batch = GRPOBatch(
        advantages=[group_advantages(torch.tensor(r["rewards"]), algo.scale_rewards) for r in records],
        old_logprobs=old, clip_eps=algo.clip_eps, loss_agg=algo.loss_agg, max_tokens=max_tokens)
    loss_fn, extras = (lambda lp: grpo_loss(lp, batch)), {}
    if algo.kl_coef > 0:
        ref = [t.completion_values(a.ref_entry_logprobs) for t, a in zip(trees, acts)]
        loss_fn = with_kl(loss_fn, ref, algo.kl_coef, algo.kl_estimator, algo.loss_agg, max_tokens)
        extras["kl"] = float(kl_loss(old, ref, algo.kl_estimator, algo.loss_agg, max_tokens))
    return *loss_and_weights(loss_fn, old), extras


def train_policy(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool's device indices this stage holds (one per data-parallel rank,
    `pool.devices_per_step` of them). With more than one rank the backward runs on
    `lsreplay.parallel.launch`ed processes (gloo on CPU; rank r on cuda:devices[r])."""
    if done := run.done(step, "policy"):
        return done
    run.begin(step, "policy")
    records, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    loss, weights, extras = grpo_weights(run, step, records, trees, prefixes)
    loss = faults.loss("policy", step, loss)
    world = run.cfg.pool.devices_per_step
    start = time.perf_counter()
    if world > 1:
        out = _data_parallel_update(run, step, weights, loss, world, devices)
    else:
        model = policy_before(run, step, trainable=True)
        optimizer = _optimizer_before(run, step, model)
        if run.cfg.replay.mode == "replay":
            stats = replay_backward(model, trees, weights, prefix_kv=StoredPrefixKV(run, prefixes),
                                    budget_bytes=run.cfg.replay.budget_mb * 2**20 or None,
                                    join_below=run.cfg.replay.join_below)
        else:
            stats = naive_backward(model, trees, weights)
        out = _commit(run, step, model, optimizer, loss, stats)
    return run.finish(step, "policy", {**out, "loss": loss, "seconds": time.perf_counter() - start, **extras})


def _optimizer_before(run: Run, step: int, model) -> torch.optim.Optimizer:
    optimizer = make_optimizer(run, model)
    if step > 0:
        with run.reading(step - 1, "policy"):
            load_optimizer(run.store, run.checkpoint("policy", step - 1), optimizer,
                           run.checkpoint_manifest("policy", step - 1))
    return optimizer


def _stats_fields(stats) -> dict:
    return {"objective": stats.objective, "positions": stats.positions,
            "per_rollout_positions": stats.per_rollout_positions, "positions_ratio": stats.positions_ratio,
            "peak_activation_bytes": stats.peak_activation_bytes, "backward_seconds": stats.seconds}


def _clip_and_step(run: Run, step: int, model, optimizer, loss: float, sharded: bool = False) -> float:
    """Clip, check, AdamW step, check; raises NonFiniteLoss (nothing is committed then).
    sharded: every rank holds a shard (FSDP), so the checks agree over ranks."""
    # grad_clip 0 means no clipping: clip_grad_norm_(..., 0) would scale every gradient to 0.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.cfg.optim.grad_clip or math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"step {step}: loss={loss} grad_norm={grad_norm}; the step was not committed "
                            "(the last good checkpoint is kept). Lower optim.lr or check the rewards.")
    optimizer.step()
    bad = [n for n, p in model.named_parameters()
           if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
    if (_any_rank(bool(bad)) if sharded else bad):
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


def _commit(run: Run, step: int, model, optimizer, loss: float, stats) -> dict:
    grad_norm = _clip_and_step(run, step, model, optimizer, loss)
    return {**_save(run, step, model, optimizer), "grad_norm": grad_norm, **_stats_fields(stats)}


def _save(run: Run, step: int, model, optimizer) -> dict:
    prefix = run.checkpoint("policy", step)
    ckpt = [save_module(run.store, prefix, model, {"step": step})]
    faults.hook("policy", step, "mid")  # a kill here leaves a partial checkpoint without a done marker
    ckpt += [save_optimizer(run.store, prefix, optimizer),
             save_rng(run.store, prefix, {"rollout": run.generator(step + 1, "trees")})]
    return {"files": [e for c in ckpt for e in c["files"].values()], "checkpoint": prefix}


# -- data parallel -----------------------------------------------------------------------
def _data_parallel_update(run: Run, step: int, weights, loss: float, world: int, devices) -> dict:
    from lsreplay.parallel import launch

    devices = list(devices) if devices is not None else list(range(world))
    if len(devices) < world:
        raise ValueError(f"pool.devices_per_step = {world} ranks but the stage holds {len(devices)} devices")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    threads = max(1, torch.get_num_threads() // world)
    outs = launch(_rank_update, world_size=world, args=(run.cfg, step, weights, loss, devices[:world]),
                  backend=backend, threads=threads)
    out = outs[0]
    if "nonfinite" in out:
        raise NonFiniteLoss(out["nonfinite"])
    return out


def _rank_update(rank: int, world: int, cfg, step: int, weights, loss: float, devices: list[int]) -> dict | None:
    """One data-parallel rank: its share of the trees' backward, gradients summed over
    ranks; then plain DP: rank 0 clips, steps and checkpoints; FSDP: every rank steps its
    shard and rank 0 writes the gathered full state."""
    from lsreplay.parallel import data_parallel_backward, shard_model

    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(devices[rank])
        device = torch.device("cuda", devices[rank])
    run = Run(cfg)
    _, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    model = policy_before(run, step, trainable=True).to(device)
    fsdp = bool(cfg.replay.fsdp)
    if fsdp:
        shard_model(model)
    weights = [[w.to(device) for w in tree] for tree in weights]
    stats = data_parallel_backward(model, trees, weights, rank, world, mode=cfg.replay.mode, fsdp=fsdp,
                                   prefix_kv=StoredPrefixKV(run, prefixes),
                                   budget_bytes=cfg.replay.budget_mb * 2**20 or None,
                                   join_below=cfg.replay.join_below)
    try:
        if fsdp:
            return _fsdp_commit(run, step, model, loss, stats, rank)
        if rank != 0:
            return None
        return _commit(run, step, model.cpu(), _optimizer_before(run, step, model), loss, stats)
    except NonFiniteLoss as e:  # travels back as a value: a rank's exception would lose its type
        return {"nonfinite": str(e)}


def _fsdp_commit(run: Run, step: int, model, loss: float, stats, rank: int) -> dict | None:
    from torch.distributed.tensor import distribute_tensor

    from lsreplay.parallel import full_state

    optimizer = make_optimizer(run, model)
    if step > 0:  # the checkpoint holds full tensors: load them, then keep each rank's shard
        with run.reading(step - 1, "policy"):
            load_optimizer(run.store, run.checkpoint("policy", step - 1), optimizer,
                           run.checkpoint_manifest("policy", step - 1))
        for p in model.parameters():
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and not hasattr(v, "to_local"):
                    optimizer.state[p][k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh,
                                                              p.placements)
    grad_norm = _clip_and_step(run, step, model, optimizer, loss, sharded=True)
    # Gather the full weights and optimizer state (collectives: every rank), rank 0 writes them.
    weights = full_state(model)
    moments = [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in optimizer.state.get(p, {}).items()} for p in model.parameters()]
    if rank != 0:
        return None
    plain = load_model(run.cfg.model, trainable=True)
    plain.load_state_dict(weights, strict=False)
    plain_opt = make_optimizer(run, plain)
    for p, state in zip(plain.parameters(), moments):
        if state:
            plain_opt.state[p] = state
    return {**_save(run, step, plain, plain_opt), "grad_norm": grad_norm, **_stats_fields(stats)}
