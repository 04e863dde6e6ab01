"""One whole step of the pipeline against a per-rollout implementation written here from the
published formulas, not from lsreplay's functions.

The pipeline's own stages run a real step 0 (so that the policy has moved away from the
frozen reference and the KL term has a gradient, and a critic's value head is no longer
zero), then step 1 on trees written by hand: leaves that end before the branch point (each
standing for the samples it would have been forked into), an answer cut at the limit, and,
for GRPO, a group whose rewards are all 1 but whose lengths differ. The policy stage's
loss and the gradient it steps with are compared with:

- GRPO (TRL's GRPOTrainer loss at loss_type="dapo", verl's GRPO outcome advantage):
  samples drawn at temperature T are scored as log_softmax(logits / T); rewards less DAPO's
  soft overlong punishment; A = (r - mean) / (std + 1e-6) over the group's G samples
  (unbiased std); per token -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) + beta k3 with
  k3 = exp(ref - logp) - (ref - logp) - 1; summed over every token of every sample and
  divided by their count; a group whose accuracy is all alike is dropped (DAPO's dynamic
  sampling).
- PPO with a critic (verl's compute_gae_advantage_return, masked_whiten and value loss):
  the reward at an answer's last token, delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, returns A + V, A whitened over the batch's tokens as
  (A - mean) / sqrt(unbiased var + 1e-8); value loss 0.5 max((V - R)^2, (clip(V, V_old +- c)
  - R)^2); DAPO's overlong filtering masks a cut answer out of every term and of the
  whitening; loss = pg + vf_coef vf + beta kl, token means over the kept tokens.

A leaf that stands for n samples is n identical samples here. Everything in float64, with
RMSNorm in float64 too, so the two sides agree to rounding. The test fails on a sign flip
of the advantages, a penalty added instead of subtracted, a wrong mask or a wrong
temperature (each tried by hand on the pipeline's code: see the closing note of issue 31).
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import assert_same_update, record_update_gradients
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lsreplay import stages
from lsreplay.core.config import load_config
from lsreplay.stages.preflight import preflight
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT

TEMPERATURE, MAX_TOKENS, BUFFER, BETA, EPS, EPS_HIGH = 0.7, 6, 3, 0.1, 0.2, 0.28
GAMMA, LAM, VF_COEF, VALUE_CLIP = 1.0, 0.95, 0.1, 0.2
COMMON = ["data.size=16", "data.prompts_per_step=3", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
          f"rollout.max_new_tokens={MAX_TOKENS}", f"rollout.temperature={TEMPERATURE}", "drafter.enabled=false",
          "model.dtype=float64", "optim.lr=1e-3", "reward.function=varied_rewards:code_parity",
          "algo.tree_baseline=group", f"algo.kl_coef={BETA}", "algo.kl_estimator=k3", f"algo.clip_eps={EPS}",
          "steps=2", "checkpoint.every=1"]
GRPO = ["algo.name=grpo", f"algo.clip_eps_high={EPS_HIGH}", "algo.overlong=penalty",
        f"algo.overlong_buffer={BUFFER}", "algo.dynamic_sampling=true", "algo.dynamic_sampling_metric=reward"]
PPO = ["algo.name=ppo", "algo.critic=true", "algo.advantage=gae", f"algo.gamma={GAMMA}", f"algo.lam={LAM}",
       f"algo.vf_coef={VF_COEF}", f"algo.value_clip={VALUE_CLIP}", "algo.overlong=mask", "algo.value_lr=1e-2"]


def step_one_trees(tokenizer) -> list[dict]:
    """Three trees of step 1 as the trees stage records them (branching [2, 2], a branch
    point after 3 tokens): leaves in depth-first order, each with its path and count."""
    d = tokenizer.convert_tokens_to_ids(list("0123456789"))
    eos = tokenizer.eos_token_id

    def tree(prompt: str, leaves: list[tuple[list[int], list[int], float]]) -> dict:
        completions = [c for c, _, _ in leaves]
        return {"prompt_index": 0, "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
                "completions": completions, "logprobs": None,
                "finished": [c[-1] == eos for c in completions], "texts": [""] * len(leaves),
                "rewards": [r for _, _, r in leaves], "reward_functions": {},
                "counts": [1 if len(p) == 2 else 2 for _, p, _ in leaves], "paths": [p for _, p, _ in leaves]}

    return [
        # One answer cut at the limit, one ended at the last level, one before the branch point.
        tree("Add 3 and 4.", [([d[1], d[2], d[3], d[4], d[5], d[6]], [0, 0], 1.0),
                              ([d[1], d[2], d[3], d[7], eos], [0, 1], 0.0),
                              ([d[8], eos], [1], 1.0)]),
        tree("Subtract 2 from 9.", [([d[2], d[2], d[2], d[3], eos], [0, 0], 0.0),
                                    ([d[2], d[2], d[2], d[4], d[5], d[6]], [0, 1], 1.0),
                                    ([d[5], d[6], d[7], eos], [1, 0], 1.0),
                                    ([d[5], d[6], d[7], d[1], d[2], eos], [1, 1], 0.0)]),
        # Every answer correct, of different lengths: the overlong penalty tells them apart,
        # accuracy does not.
        tree("Multiply 2 by 3.", [([d[6], d[1], d[2], eos], [0, 0], 1.0),
                                  ([d[6], d[1], d[2], d[4], d[5], eos], [0, 1], 1.0),
                                  ([d[6], eos], [1], 1.0)]),
    ]


def run_pipeline(tmp_path, model_dir, algo: list[str], monkeypatch):
    """Step 0 by the pipeline, then step 1 on the hand-written trees; returns (its policy
    manifest, the gradient it stepped with by parameter name, the run)."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", *COMMON, *algo])
    run = preflight(cfg)
    run.save_or_check_config()
    for stage in (stages.sample_prompts, stages.generate_trees, stages.cache_prefixes, stages.train_policy):
        stage(run, 0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    run.begin(1, "trees")
    entry = run.store.write_json(run.key(1, "trees.json"), {"trees": step_one_trees(tokenizer)})
    run.finish(1, "trees", {"files": [entry]})
    seen = record_update_gradients(monkeypatch)
    stages.cache_prefixes(run, 1)
    policy = stages.train_policy(run, 1)
    checkpointing.WRITER.wait()
    RESIDENT.release(run)
    return policy, seen, run


def scored(model, value_head, prompt: list[int], completion: list[int]):
    """(log_softmax(logits / T) of each completion token, V at the positions predicting
    them), one rollout's full sequence through the model with grad."""
    hidden = model.model(input_ids=torch.tensor([prompt + completion])).last_hidden_state[0]
    at = hidden[len(prompt) - 1: len(prompt) - 1 + len(completion)]
    logp = (model.lm_head(at) / TEMPERATURE).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return logp, None if value_head is None else value_head(at).squeeze(-1)


def samples(trees: list[dict]):
    """Every tree's leaves as the G samples they stand for: (tree, prompt, completion, reward, finished)."""
    return [(i, t["prompt_ids"], c, r, f) for i, t in enumerate(trees)
            for c, r, f, n in zip(t["completions"], t["rewards"], t["finished"], t["counts"]) for _ in range(n)]


def dapo_length_reward(length: int) -> float:
    """DAPO's soft overlong punishment (its eq. 13) at L_max = max_new_tokens, L_cache = the buffer."""
    if length <= MAX_TOKENS - BUFFER:
        return 0.0
    return (MAX_TOKENS - BUFFER - length) / BUFFER if length <= MAX_TOKENS else -1.0


def models(run, model_dir, critic: bool):
    """The policy after step 0 (its checkpoint's HF folder, and value head), and the frozen
    reference (the base model), both float64."""
    folder = Path(run.store.url(run.checkpoint("policy", 0)))
    policy = AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    head = None
    if critic:
        weights = load_file(str(folder / "critic.safetensors"))
        head = torch.nn.Linear(weights["value_head.weight"].shape[1], 1, dtype=torch.float64)
        head.load_state_dict({k.removeprefix("value_head."): v for k, v in weights.items()})
    return policy, reference, head


def grpo_reference(run, model_dir, trees):
    policy, reference, _ = models(run, model_dir, critic=False)
    batch = samples(trees)
    keep = [i for i in range(len(trees)) if len(set(trees[i]["rewards"])) > 1]  # dynamic sampling on accuracy
    shaped = torch.tensor([r + dapo_length_reward(len(c)) for _, _, c, r, _ in batch], dtype=torch.float64)
    group = torch.tensor([i for i, *_ in batch])
    advantages = torch.zeros_like(shaped)
    for i in keep:
        r = shaped[group == i]
        advantages[group == i] = (r - r.mean()) / (r.std() + 1e-6)
    per_token = []
    for (i, prompt, completion, _, _), a in zip(batch, advantages):
        if i not in keep:
            continue
        logp, _ = scored(policy, None, prompt, completion)
        with torch.no_grad():
            ref, _ = scored(reference, None, prompt, completion)
        rho = torch.exp(logp - logp.detach())
        pg = -torch.minimum(rho * a, rho.clamp(1 - EPS, 1 + EPS_HIGH) * a)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token.append(pg + BETA * kl)
    loss = torch.cat(per_token).sum() / sum(t.numel() for t in per_token)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in policy.named_parameters()}


def ppo_reference(run, model_dir, trees):
    policy, reference, head = models(run, model_dir, critic=True)
    batch = samples(trees)
    scores = [scored(policy, head, prompt, completion) for _, prompt, completion, _, _ in batch]
    keep = [f for *_, f in batch]  # DAPO's overlong filtering: a cut answer is in no term
    advantages, returns = [], []
    for (_, _, _, reward, _), (_, values) in zip(batch, scores):
        v = values.detach()
        rewards = torch.zeros_like(v)
        rewards[-1] = reward
        last, adv = 0.0, torch.zeros_like(v)
        for t in reversed(range(len(v))):
            following = v[t + 1] if t + 1 < len(v) else 0.0
            last = rewards[t] + GAMMA * following - v[t] + GAMMA * LAM * last
            adv[t] = last
        advantages.append(adv)
        returns.append(adv + v)
    kept_adv = torch.cat([a for a, k in zip(advantages, keep) if k])
    mean, var = kept_adv.mean(), kept_adv.var(unbiased=True)
    pg, vf, kl = [], [], []
    for (_, prompt, completion, _, k), (logp, values), a, ret in zip(batch, scores, advantages, returns):
        if not k:
            continue
        a = (a - mean) * torch.rsqrt(var + 1e-8)
        with torch.no_grad():
            ref, _ = scored(reference, None, prompt, completion)
        rho = torch.exp(logp - logp.detach())
        pg.append(-torch.minimum(rho * a, rho.clamp(1 - EPS, 1 + EPS) * a))
        old = values.detach()
        clipped = old + (values - old).clamp(-VALUE_CLIP, VALUE_CLIP)
        vf.append(0.5 * torch.maximum((values - ret) ** 2, (clipped - ret) ** 2))
        kl.append(torch.exp(ref - logp) - (ref - logp) - 1)
    tokens = sum(t.numel() for t in pg)
    loss = (torch.cat(pg).sum() + VF_COEF * torch.cat(vf).sum() + BETA * torch.cat(kl).sum()) / tokens
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    grads.update({f"value_head.{n}": p.grad for n, p in head.named_parameters()})
    return float(loss.detach()), grads


def test_a_grpo_step_equals_trls_loss_on_the_sampled_distribution(exact_rmsnorm, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    policy, seen, run = run_pipeline(tmp_path, tiny_model_dir, GRPO, monkeypatch)
    trees = step_one_trees(AutoTokenizer.from_pretrained(tiny_model_dir))
    loss, grads = grpo_reference(run, tiny_model_dir, trees)
    assert policy["trees_left_out"] == 1  # the all-correct group of different lengths
    assert_same_update(policy, seen, loss, grads)


def test_a_ppo_step_with_a_critic_equals_verls_gae_and_value_loss(exact_rmsnorm, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    policy, seen, run = run_pipeline(tmp_path, tiny_model_dir, PPO, monkeypatch)
    trees = step_one_trees(AutoTokenizer.from_pretrained(tiny_model_dir))
    loss, grads = ppo_reference(run, tiny_model_dir, trees)
    assert_same_update(policy, seen, loss, grads)
