"""Context parallelism (lsreplay/distributed/context.py): a tree's prompt split over 2 and 3
gloo ranks, real processes, float64. Every parameter's gradient, summed over the ranks (one
data-parallel reduction), equals the single-process replay and the per-rollout reference
within 1e-6 of max|grad| per tensor (HF's RMSNorm computes in float32, so a correct result
lands near 1e-7): a prompt of 41 tokens (shares of 21/20 and 14/14/13), leaves fewer than
ranks, a second branching level run every way replay runs it (its spans layer by layer on the
split prompt, kept with layers run again, recomputed after their subtree), short trees in the
same batch on today's path, GRPO and PPO with a critic, LoRA on and off, FSDP2 on and off."""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field

import pytest
import torch
from torch.multiprocessing.spawn import ProcessException

from conftest import RAW_LOGPROB, tiny_model

from lsreplay.algos.backward import capture_logprobs
from lsreplay.algos.critic import VALUE, CriticBatch, attach_value_head, critic_heads, gae
from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.ppo import PPOBatch, ppo_loss
from lsreplay.algos.weights import loss_and_weights
from lsreplay.core.config import LoraConfig
from lsreplay.distributed.context import ContextParallel, shares
from lsreplay.distributed.parallel import data_parallel_backward, full_grads, launch, shard_model
from lsreplay.models.distribution import RAW
from lsreplay.models.lora import add_adapters
from lsreplay.replay.backward import naive_backward, replay_backward, replay_plan, splits
from lsreplay.replay.memory import LayerByLayer
from lsreplay.replay.view import replay_view
from lsreplay.tree import RolloutTree

TOL = 1e-6
PROMPT = 41  # tokens: uneven over 2 and 3 ranks
THRESHOLD = 20  # prompts of at least this many tokens are split; the short trees' are not
# Budgets (bytes) at which each rank's share runs in chunks shorter than itself and, below it,
# level-1 spans run layer by layer on the split prompt (LAYERED), or are recomputed after their
# subtree (RECOMPUTED, on 2 ranks), beside spans kept with their layers run again (both).
LAYERED = 95_367
RECOMPUTED = 149_011


def long_tree(seed: int = 0, leaves_only: int = 0) -> RolloutTree:
    """A 41-token prompt; three level-1 spans of 8 tokens, each forking into two leaves (a
    second branching level), and a leaf of its own. `leaves_only`: that many leaves instead."""
    rng = random.Random(seed)
    prompt = [rng.randrange(64) for _ in range(PROMPT)]
    if leaves_only:
        return RolloutTree.from_sequences(prompt, [[b + 1] + [rng.randrange(64) for _ in range(4)]
                                                   for b in range(leaves_only)])
    completions = []
    for branch in range(3):
        stem = [branch + 1] + [rng.randrange(64) for _ in range(7)]
        completions += [stem + [10 + leaf] + [rng.randrange(64) for _ in range(rng.randrange(2, 5))]
                        for leaf in range(2)]
    return RolloutTree.from_sequences(prompt, completions + [[60, 61, 62]])


def short_trees() -> list[RolloutTree]:
    rng = random.Random(1)
    return [RolloutTree.from_sequences([rng.randrange(64) for _ in range(6)],
                                       [[b + 1] + [rng.randrange(64) for _ in range(3)] for b in range(3)])
            for _ in range(2)]


@dataclass
class Case:
    """One batch to replay on the ranks: the model's state, the trees, the loss's weights by
    head, and how the ranks hold the model."""

    name: str
    trees: list[RolloutTree]
    heads: str = "logprob"  # or "critic"
    lora: bool = False
    fsdp: bool = False
    budget: int | None = None
    state: dict = field(default_factory=dict)
    weights: dict | list = field(default_factory=list)


def make_model(case: Case):
    model = tiny_model()
    if case.lora:
        add_adapters(model, LoraConfig(enabled=True, rank=4, alpha=8.0), seed=0)
    if case.heads == "critic":
        attach_value_head(model)
    return model


def heads_of(case: Case):
    return critic_heads(RAW) if case.heads == "critic" else RAW_LOGPROB


def prepared(case: Case) -> Case:
    """The case's model (random LoRA B and value head, so both train) and its loss's weights,
    from a caching pass: GRPO, or PPO with a critic on GAE returns of random rewards."""
    model = make_model(case)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name or name.startswith("value_head."):
                param.copy_(0.3 * torch.randn(param.shape, generator=g, dtype=torch.float64))
    heads = heads_of(case)
    scores, _ = capture_logprobs(model, case.trees, keep_kv=False, heads=heads)
    rewards = [torch.randint(0, 3, (len(t.completions),), generator=g).double() for t in case.trees]
    if case.heads == "critic":
        old = scores[VALUE]
        returns = [[gae(v, float(r), gamma=0.9, lam=0.8)[1] for v, r in zip(vs, rs)] for vs, rs in zip(old, rewards)]
        advantages = [[torch.randn(len(c), generator=g, dtype=torch.float64) for c in t.completions]
                      for t in case.trees]
        batch = PPOBatch(advantages=advantages, old_logprobs=scores["logprob"], clip_eps=0.1,
                         critic=CriticBatch(old_values=old, returns=returns, clip=0.1), vf_coef=0.5)
        _, case.weights = loss_and_weights(lambda s: ppo_loss(s, batch), scores)
    else:
        batch = GRPOBatch(advantages=[group_advantages(r) for r in rewards], old_logprobs=scores)
        _, case.weights = loss_and_weights(lambda lp: grpo_loss(lp, batch), scores)
    case.state = {k: v.clone() for k, v in model.state_dict().items()}
    return case


def cases(world: int) -> list[Case]:
    both = [long_tree(0), *short_trees(), long_tree(3)]
    out = [Case("grpo, spans layer by layer", both, budget=LAYERED),
           Case("grpo, spans recomputed", both, budget=RECOMPUTED),
           Case("ppo with a critic", both, heads="critic", budget=LAYERED),
           Case("lora", [long_tree(0), *short_trees()], lora=True, budget=RECOMPUTED),
           Case("fsdp2", [long_tree(0), *short_trees()], fsdp=True, budget=LAYERED)]
    if world == 3:  # the shares and the rounds on three ranks; LoRA and FSDP2 change nothing there
        out = [out[0], out[2], Case("fewer leaves than ranks", [long_tree(5, leaves_only=2)], heads="critic")]
    return [prepared(c) for c in out]


def _rank(rank: int, world: int, batch: list[Case]) -> dict:
    out = {}
    for case in batch:
        model = make_model(case)
        model.load_state_dict(case.state)
        if case.fsdp:
            shard_model(model)
        stats = data_parallel_backward(model, case.trees, case.weights, rank, world, heads=heads_of(case),
                                       budget_bytes=case.budget, context_parallel=world,
                                       context_threshold=THRESHOLD)
        grads = full_grads(model)
        out[case.name] = {"grads": {n: g for n, g in grads.items() if g is not None},
                          "positions": stats.positions, "per_rollout": stats.per_rollout_positions}
    # Ranks that read different trees stop at once, every one of them naming both.
    tree = long_tree(0) if rank == 0 else RolloutTree.from_sequences(long_tree(0).prompt_ids + [7],
                                                                         long_tree(0).completions)
    try:
        replay_backward(tiny_model(), [tree], [[torch.ones(len(c), dtype=torch.float64) for c in tree.completions]],
                        heads=RAW_LOGPROB, context=ContextParallel(list(range(world)), rank, THRESHOLD))
    except ValueError as e:
        out["disagree"] = str(e)
    return out


def references(case: Case) -> tuple[dict, dict, object]:
    """The single-process replay's gradients and the per-rollout reference's."""
    out = []
    for backward in (replay_backward, naive_backward):
        model = make_model(case)
        model.load_state_dict(case.state)
        kwargs = {"budget_bytes": case.budget} if backward is replay_backward else {}
        stats = backward(model, case.trees, case.weights, heads=heads_of(case), **kwargs)
        out.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats))
    return out[0][0], out[1][0], out[0][1]


def worst(ref: dict, got: dict) -> float:
    assert ref.keys() == got.keys()
    return max(float((got[n] - r).abs().max() / r.abs().max().clamp_min(1e-300)) for n, r in ref.items())


@pytest.mark.parametrize("world", [2, 3])
def test_split_prompts_are_exact(world):
    batch = cases(world)
    outs = launch(_rank, world, args=(batch,), threads=1)
    for case in batch:
        replay, naive, stats = references(case)
        got = outs[0][case.name]
        assert all(o[case.name]["grads"].keys() == got["grads"].keys() for o in outs)  # every rank: the sum
        assert worst(replay, got["grads"]) <= TOL, case.name
        assert worst(naive, got["grads"]) <= TOL, case.name
        assert got["per_rollout"] == stats.per_rollout_positions, case.name
        assert got["positions"] >= stats.positions - (world - 1) * PROMPT, case.name  # the prompt counted once
        if case.lora:
            assert all("lora_" in n for n in got["grads"])
    for rank, out in enumerate(outs):
        assert "ranks 0 and 1 of a context-parallel group disagree" in out["disagree"], rank
        assert f"a prompt of {PROMPT} tokens" in out["disagree"] and f"one of {PROMPT + 1} tokens" in out["disagree"]


def test_the_budgets_take_the_paths_the_cases_name():
    """At the budgets above every rank's share runs in chunks shorter than itself, and the
    level-1 spans, each replayed by the rank it goes to, take every path replay has below
    the split prompt."""
    model, tree = tiny_model(), long_tree(0)
    spans = replay_view(tree, 0)
    children = [spans[c] for c in spans[0].children]
    for world, budget, paths in ((2, LAYERED, {"layer by layer", "kept"}), (3, LAYERED, {"layer by layer", "kept"}),
                                 (2, RECOMPUTED, {"recomputed", "kept"})):
        taken = set()
        for index in range(world):
            context = ContextParallel(list(range(world)), index, THRESHOLD)
            lo, hi = shares(PROMPT, world)[index]
            _, kept, _ = replay_plan(model, tree, 0, budget, context=context)
            assert kept[0].chunk < hi - lo
            for child in context.children(spans, children):
                if not child.is_leaf:
                    choice = kept.get(child.id)
                    taken.add("recomputed" if choice is None else
                              "layer by layer" if isinstance(choice, LayerByLayer) else "kept")
        assert taken == paths, (world, budget, taken)


def test_shares_and_which_trees_split():
    assert shares(41, 2) == [(0, 21), (21, 41)]
    assert shares(41, 3) == [(0, 14), (14, 28), (28, 41)]
    model = tiny_model()
    long, short = long_tree(0), short_trees()[0]
    context = ContextParallel([0, 1], 0, THRESHOLD)
    assert splits(model, long, context) and not splits(model, short, context)
    assert not splits(model, long, None) and not splits(model, long, ContextParallel([0], 0, THRESHOLD))
    # No threshold: split where one device would need more than the budget.
    automatic = ContextParallel([0, 1], 0)
    assert splits(model, long, automatic, budget_bytes=LAYERED // 2)
    assert not splits(model, long, automatic, budget_bytes=RECOMPUTED * 4)
    # The children go to the ranks whole, largest first, each rank a share.
    spans = replay_view(long, 0)
    children = [spans[c] for c in spans[0].children]
    mine = [ContextParallel([0, 1, 2], r).children(spans, children) for r in range(3)]
    assert sorted(c.id for m in mine for c in m) == sorted(c.id for c in children)
    assert all(len(m) >= 1 for m in mine)


def test_a_rank_that_dies_fails_the_step():
    """Rank 1 killed in the middle of the split prompt's forward: rank 0, waiting on it, fails
    too, and the launch raises (the stage fails and is retried as any stage failure is)."""
    with pytest.raises(ProcessException, match="SIGKILL|Connection (closed|reset) by peer"):
        launch(_dying, 2, threads=1)


def _dying(rank: int, world: int) -> None:
    tree = long_tree(0)
    weights = [[torch.ones(len(c), dtype=torch.float64) for c in tree.completions]]
    model = tiny_model()
    if rank == 1:
        model.model.layers[1].mlp.forward = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    data_parallel_backward(model, [tree], weights, rank, world, heads=RAW_LOGPROB, context_parallel=world,
                           context_threshold=THRESHOLD)
