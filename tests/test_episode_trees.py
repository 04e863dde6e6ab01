"""Branch replay over multi-turn episode trees equals per-episode training, in float64.

An episode's completion interleaves the model's replies with environment tokens (tool
results, the environment's messages, the template around them). The episodes of a prompt
form one trie; the environment tokens lie in it at several depths: in the history every
episode shares, under a branch point, right before one (episodes branching after the
environment's answer), and in a leaf's own tail. Episodes end at different turns.

The per-episode reference is written here from scratch, as TRL computes it: one forward per
episode (prompt + completion), each token's logprob, and the loss over the tokens the
tool mask keeps (the model's), its denominators counting those alone. Replay differentiates
the pipeline's loss wrapped by `on_model_tokens`; both gradients must agree to 1e-6 (HF's
RMSNorm runs in float32), and to 1e-11 with every op in float64.
"""

import copy
import functools

import pytest
import torch
from conftest import RAW_LOGPROB, tiny_model

from lsreplay.algos.backward import capture_logprobs, naive_loss_backward, replay_loss_backward
from lsreplay.algos.critic import VALUE, CriticBatch, attach_value_head, critic_heads, gae
from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.model_tokens import model_tokens, on_model_tokens, sampled_masks
from lsreplay.algos.ppo import PPOBatch, ppo_loss
from lsreplay.algos.weights import loss_and_weights
from lsreplay.models.distribution import RAW
from lsreplay.tree import RolloutTree

EOS = 0


def M(*tokens):  # the model's reply
    return [(t, True) for t in tokens]


def E(*tokens):  # the environment's answer
    return [(t, False) for t in tokens]


# Two prompts' episodes. Tree 0 branches after the first environment answer, which every
# episode of the first subtree shares (E(60, 61)), again inside the second reply and after
# the second answer; one episode ends at turn 1, one at turn 2, the others at turn 3.
# Tree 1: environment tokens only in tails, and two episodes that differ only after one.
EPISODES = [
    ([9, 8, 7], [
        M(1, 2, EOS) + E(60, 61) + M(3, 4, EOS) + E(60, 62) + M(5, EOS),
        M(1, 2, EOS) + E(60, 61) + M(3, 6, EOS),
        M(1, 2, EOS) + E(60, 61) + M(7, EOS) + E(63) + M(8, 9, EOS),
        M(1, 2, EOS) + E(60, 61) + M(7, EOS) + E(63) + M(10, EOS),
        M(11, EOS),
        M(11, 12, EOS) + E(60) + M(13, EOS),
    ]),
    ([20, 21], [
        M(14, 15, 16, EOS) + E(50, 51, 52, 53) + M(17, EOS),
        M(14, 15, 16, EOS) + E(50, 51, 52, 53) + M(18, 19, EOS),
        M(22, EOS) + E(54),
        M(23, 24, 25, EOS),
    ]),
]


def episode_trees():
    trees = [RolloutTree.from_sequences(p, [[t for t, _ in ep] for ep in eps]) for p, eps in EPISODES]
    sampled = sampled_masks([[[s for _, s in ep] for ep in eps] for _, eps in EPISODES])
    return trees, sampled


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    model = tiny_model(arch, dtype=torch.float64, initializer_range=0.1)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0, generator=torch.Generator().manual_seed(4))
    return model


def fresh(arch: str, critic: bool = False):
    model = copy.deepcopy(_model(arch))
    if critic:
        attach_value_head(model)
        with torch.no_grad():
            model.value_head.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    return model


def grads(model) -> dict:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() / b[n].abs().max().item() for n in b)


def rewards():
    return [torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 3.0, 2.0])]


def per_episode_loss(model, loss_agg: str, max_tokens: int = 12) -> torch.Tensor:
    """TRL's GRPO loss at ratio 1, per episode: one forward each, the tool mask applied."""
    advantages = [group_advantages(r) for r in rewards()]
    losses, masks = [], []
    for (prompt, eps), adv in zip(EPISODES, advantages):
        for ep, a in zip(eps, adv):
            ids = torch.tensor([prompt + [t for t, _ in ep]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            losses.append(-a * torch.exp(lp - lp.detach()))
            masks.append(torch.tensor([s for _, s in ep], dtype=torch.float64))
    if loss_agg == "token-mean":
        return sum((l * m).sum() for l, m in zip(losses, masks)) / sum(m.sum() for m in masks)
    if loss_agg == "seq-mean":
        return sum((l * m).sum() / m.sum() for l, m in zip(losses, masks)) / len(losses)
    return sum((l * m).sum() for l, m in zip(losses, masks)) / (len(losses) * max_tokens)


def pipeline_grpo(model, trees, sampled, loss_agg: str, max_tokens: int = 12):
    old, _ = capture_logprobs(model, trees, keep_kv=False, heads=RAW_LOGPROB)
    batch = GRPOBatch(advantages=[group_advantages(r) for r in rewards()], old_logprobs=model_tokens(old, sampled),
                      loss_agg=loss_agg, max_tokens=max_tokens)
    return on_model_tokens(lambda lp: grpo_loss(lp, batch), sampled)


def test_the_trees_share_histories_with_environment_tokens_at_several_depths():
    trees, sampled = episode_trees()
    assert [t.depth for t in trees] == [3, 2]
    assert sum(t.unique_positions for t in trees) < sum(t.total_positions for t in trees)
    # Environment tokens in a shared node (above a branch point) and in leaves.
    env_nodes = {(i, node.id) for i, (tree, flags) in enumerate(zip(trees, sampled))
                 for node in tree.nodes for j, c in enumerate(tree.completions)
                 for k in range(len(c)) if not flags[j][k] and node.start <= tree.prompt_len + k < node.end}
    shared = [(i, n) for i, n in env_nodes if not trees[i].nodes[n].is_leaf]
    assert shared and len(shared) < len(env_nodes)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replay_equals_per_episode_grpo_with_the_tool_mask(arch, loss_agg):
    trees, sampled = episode_trees()
    model = fresh(arch)
    loss_fn = pipeline_grpo(model, trees, sampled, loss_agg)
    replay_loss, stats = replay_loss_backward(model, trees, loss_fn, heads=RAW_LOGPROB)
    replay = grads(model)
    reference = per_episode_loss(model, loss_agg)
    reference.backward()
    per_episode = grads(model)
    reference = float(reference.detach())
    assert abs(replay_loss - reference) <= 1e-9 * max(1.0, abs(reference))
    assert max_rel_diff(replay, per_episode) <= 1e-6
    assert stats.positions < stats.per_rollout_positions
    # Without the mask the environment's tokens would train: another gradient.
    unmasked_old, _ = capture_logprobs(model, trees, keep_kv=False, heads=RAW_LOGPROB)
    unmasked = GRPOBatch(advantages=[group_advantages(r) for r in rewards()], old_logprobs=unmasked_old,
                         loss_agg=loss_agg, max_tokens=24)
    replay_loss_backward(model, trees, lambda lp: grpo_loss(lp, unmasked), heads=RAW_LOGPROB)
    assert max_rel_diff(grads(model), per_episode) > 1e-2


def test_environment_tokens_get_no_weight():
    trees, sampled = episode_trees()
    model = fresh("llama")
    old, _ = capture_logprobs(model, trees, keep_kv=False, heads=RAW_LOGPROB)
    _, weights = loss_and_weights(pipeline_grpo(model, trees, sampled, "token-mean"), old)
    for tree_w, tree_s in zip(weights, sampled):
        for w, s in zip(tree_w, tree_s):
            assert torch.all(w[~s] == 0) and torch.any(w[s] != 0)


def ppo_critic_loss(model, trees, sampled):
    """PPO with a critic over the model's tokens: old values and logprobs from the caching
    pass, GAE from them on each episode's model tokens, one SGD step away from those
    weights so that ratios and values clip."""
    scores, _ = capture_logprobs(model, trees, keep_kv=False, heads=critic_heads(RAW))
    old_lp, old_v = model_tokens(scores["logprob"], sampled), model_tokens(scores[VALUE], sampled)
    pairs = [[gae(v, float(r), gamma=0.9, lam=0.8) for v, r in zip(vs, rs)] for vs, rs in zip(old_v, rewards())]
    critic = CriticBatch(old_values=old_v, returns=[[ret for _, ret in row] for row in pairs], clip=0.1)
    batch = PPOBatch(advantages=[[adv for adv, _ in row] for row in pairs], old_logprobs=old_lp, clip_eps=0.1,
                     critic=critic, vf_coef=0.5)
    loss_fn = on_model_tokens(lambda s: ppo_loss(s, batch), sampled)
    replay_loss_backward(model, trees, loss_fn, heads=critic_heads(RAW))
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    torch.optim.SGD(model.parameters(), lr=0.1 / float(norm)).step()
    model.zero_grad(set_to_none=True)
    return loss_fn


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replay_equals_per_episode_ppo_with_a_critic(arch):
    trees, sampled = episode_trees()
    model = fresh(arch, critic=True)
    loss_fn = ppo_critic_loss(model, trees, sampled)
    replay_loss, _ = replay_loss_backward(model, trees, loss_fn, heads=critic_heads(RAW))
    replay = grads(model)
    naive_loss = naive_loss_backward(model, trees, loss_fn, heads=critic_heads(RAW))
    per_episode = grads(model)
    assert abs(replay_loss - naive_loss) <= 1e-9 * max(1.0, abs(naive_loss))
    assert max_rel_diff(replay, per_episode) <= 1e-6
    assert "value_head.weight" in replay


@pytest.mark.parametrize("name", ["grpo", "ppo-critic"])
def test_episode_replay_is_exact_without_float32_norm(exact_rmsnorm, name):
    trees, sampled = episode_trees()
    model = fresh("llama", critic=name == "ppo-critic")
    if name == "grpo":
        loss_fn, heads = pipeline_grpo(model, trees, sampled, "token-mean"), RAW_LOGPROB
    else:
        loss_fn, heads = ppo_critic_loss(model, trees, sampled), critic_heads(RAW)
    replay_loss, _ = replay_loss_backward(model, trees, loss_fn, heads=heads)
    replay = grads(model)
    if name == "grpo":
        reference = per_episode_loss(model, "token-mean")
        reference.backward()
        naive_loss = float(reference.detach())
    else:
        naive_loss = naive_loss_backward(model, trees, loss_fn, heads=heads)
    assert abs(replay_loss - naive_loss) <= 1e-12 * max(1.0, abs(naive_loss))
    assert max_rel_diff(replay, grads(model)) <= 1e-11


def test_online_dpo_on_episodes_scores_the_models_tokens_only():
    """The DPO objective over episode trees (stages.objectives): each tree's best episode
    against its worst, sequence logprobs summed over the model's tokens, for the policy and the
    reference alike; replay's gradient equals the per-episode reference written from scratch."""
    from lsreplay.core.config import load_config
    from lsreplay.stages.objectives import _dpo

    trees, sampled = episode_trees()
    model, reference = fresh("llama"), fresh("qwen2")
    _, acts = capture_logprobs(model, trees, keep_kv=False, heads=RAW_LOGPROB)
    ref_lp, _ = capture_logprobs(reference, trees, keep_kv=False, heads=RAW_LOGPROB)
    _, ref_acts = capture_logprobs(reference, trees, keep_kv=False, heads=RAW_LOGPROB)
    for a, r in zip(acts, ref_acts):
        a.ref_entry_logprobs = r.entry_logprobs
    records = [{"completions": [[t for t, _ in ep] for ep in eps], "sampled": [[s for _, s in ep] for ep in eps],
                "rewards": [float(x) for x in rw], "finished": [True] * len(eps)}
               for (_, eps), rw in zip(EPISODES, rewards())]
    cfg = load_config(None, ["algo.name=dpo", "algo.dpo_beta=0.5"])
    goal = _dpo(cfg, records, trees, acts)
    replay_loss, _ = replay_loss_backward(model, trees, goal.loss_for([0, 1]), heads=RAW_LOGPROB)
    replay = grads(model)

    losses = []
    for (prompt, eps), rw, ref in zip(EPISODES, rewards(), ref_lp):
        best, worst = int(rw.argmax()), int(rw.argmin())

        def seq(j, lm=model):
            ids = torch.tensor([prompt + [t for t, _ in eps[j]]])
            logits = lm(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            return lp[torch.tensor([s for _, s in eps[j]])].sum()

        mask = [torch.tensor([s for _, s in eps[j]]) for j in (best, worst)]
        margin = (seq(best) - ref[best][mask[0]].sum()) - (seq(worst) - ref[worst][mask[1]].sum())
        losses.append(-torch.nn.functional.logsigmoid(0.5 * margin))
    reference_loss = sum(losses) / len(losses)
    reference_loss.backward()
    assert abs(replay_loss - float(reference_loss.detach())) <= 1e-9
    assert max_rel_diff(replay, grads(model)) <= 1e-6
