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


def train_policy(run: Run, step: int) -> dict:
    if done := run.done(step, "policy"):
        return done
    run.begin(step, "policy")
    records, trees = load_trees(run, step)
    prefixes = run.manifest(step, "prefixes")
    loss, weights, extras = grpo_weights(run, step, records, trees, prefixes)
    loss = faults.loss("policy", step, loss)
    model = policy_before(run, step, trainable=True)
    optimizer = make_optimizer(run, model)
    if step > 0:
        with run.reading(step - 1, "policy"):
            load_optimizer(run.store, run.checkpoint("policy", step - 1), optimizer,
                           run.checkpoint_manifest("policy", step - 1))
    start = time.perf_counter()
    if run.cfg.replay.mode == "replay":
        stats = replay_backward(model, trees, weights, prefix_kv=StoredPrefixKV(run, prefixes),
                                budget_bytes=run.cfg.replay.budget_mb * 2**20 or None)
    else:
        stats = naive_backward(model, trees, weights)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.cfg.optim.grad_clip))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"step {step}: loss={loss} grad_norm={grad_norm}; the step was not committed "
                            "(the last good checkpoint is kept). Lower optim.lr or check the rewards.")
    optimizer.step()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise NonFiniteLoss(f"step {step}: the optimizer step made {len(bad)} parameters non-finite ({bad[0]}, ...); "
                            "the step was not committed (the last good checkpoint is kept). Lower optim.lr.")
    prefix = run.checkpoint("policy", step)
    ckpt = [save_module(run.store, prefix, model, {"step": step})]
    faults.hook("policy", step, "mid")  # a kill here leaves a partial checkpoint without a done marker
    ckpt += [save_optimizer(run.store, prefix, optimizer),
             save_rng(run.store, prefix, {"rollout": run.generator(step + 1, "trees")})]
    files = [e for c in ckpt for e in c["files"].values()]
    return run.finish(step, "policy", {
        "files": files, "checkpoint": prefix, "loss": loss, "grad_norm": grad_norm,
        "objective": stats.objective, "positions": stats.positions,
        "per_rollout_positions": stats.per_rollout_positions, "positions_ratio": stats.positions_ratio,
        "peak_activation_bytes": stats.peak_activation_bytes, "backward_seconds": stats.seconds,
        "seconds": time.perf_counter() - start, **extras})
