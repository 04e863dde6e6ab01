"""One step of asynchronous RL (rollout.max_staleness = 1) against a per-rollout implementation
written here from the published formulas, not from lsreplay's functions; and a tree older
than the bound, forged into the step, dropped.

The pipeline's own stages run steps 0 and 1, then sample step 2's trees: by the policy after
update 1 (version 1, one update stale when update 2 trains on them). One of step 1's trees,
sampled by version 0 (two updates stale at step 2), is forged into step 2's trees. The
policy stage's loss and the gradient it steps with are compared with, in float64:

- behaviour (the default): GRPO's clipped surrogate against the behaviour policy, the one
  that sampled, its logprobs as the sampler recorded them (checked against version 1's):
  Schulman et al.'s PPO with the sampler as the old policy, as verl's bypass mode and AReaL
  without the decoupled loss; per token -min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho =
  pi_theta / pi_behaviour;
- decoupled (algo.decoupled=true; AReaL's decoupled PPO, Hilton et al. 2022, eq. 5 of the
  AReaL paper, token_truncate): per token -w min(r A, clip(r, 1 - eps, 1 + eps) A), r =
  pi_theta / pi_proximal, pi_proximal the policy at the update's start (recomputed), and the
  behaviour weight w = min(pi_proximal / pi_behaviour, cap), no gradient through it;

with A = (R - mean) / (std + 1e-6) over a tree's G samples (unbiased std; a leaf that ends
before the branch point stands for the samples it would have been forked into: the tree
estimator as synchronous steps use it), every probability that of the sampled distribution
(log_softmax(logits / T)), summed over the tokens of every sample of the trees within the
bound and divided by their count. The forged tree is in no term and no denominator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_update, record_update_gradients
from transformers import AutoModelForCausalLM

from lsreplay import stages
from lsreplay.core.config import ConfigError, load_config
from lsreplay.stages.common import load_trees
from lsreplay.stages.preflight import preflight
from lsreplay.stages.versions import sampling_version
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT

TEMPERATURE, EPS, CAP = 0.7, 0.2, 1.05
COMMON = ["data.size=16", "data.prompts_per_step=3", "rollout.branching=[2,2]", "rollout.segment_tokens=[2]",
          "rollout.max_new_tokens=5", f"rollout.temperature={TEMPERATURE}", "rollout.max_staleness=1",
          "drafter.enabled=false", "model.dtype=float64", "optim.lr=0.05", "reward.function=varied_rewards:code_parity",
          "algo.tree_baseline=group", f"algo.clip_eps={EPS}", f"algo.behaviour_cap={CAP}", "steps=3",
          "checkpoint.keep_last=0"]


def run_pipeline(tmp_path, model_dir, algo: list[str], monkeypatch):
    """Steps 0 and 1 by the pipeline, then step 2 on its sampled trees plus the forged one;
    returns (step 2's policy manifest, the gradient it stepped with by name, its trees, the run)."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", *COMMON, *algo])
    run = preflight(cfg)
    run.save_or_check_config()
    for step in (0, 1):
        for stage in (stages.sample_prompts, stages.generate_trees, stages.cache_prefixes, stages.train_policy):
            stage(run, step)
    stages.sample_prompts(run, 2)
    stages.generate_trees(run, 2)
    fresh = [{k: v for k, v in r.items() if k != "staleness"} for r in load_trees(run, 2)[0]]
    forged = {k: v for k, v in load_trees(run, 1)[0][0].items() if k != "staleness"}
    assert [r["policy_version"] for r in fresh] == [1] * 3 and forged["policy_version"] == 0
    run.begin(2, "trees")
    entry = run.store.write_json(run.key(2, "trees.json"), {"trees": [*fresh, forged]})
    run.finish(2, "trees", {"files": [entry]})
    seen = record_update_gradients(monkeypatch)
    stages.cache_prefixes(run, 2)
    policy = stages.train_policy(run, 2)
    checkpointing.WRITER.wait()
    RESIDENT.release(run)
    return policy, seen, fresh, run


def scored(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, one rollout's full sequence through the model."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
    return (logits / TEMPERATURE).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def policy_of_version(run, version: int):
    """The policy after `version` updates: its checkpoint's HF folder (float64)."""
    return AutoModelForCausalLM.from_pretrained(Path(run.store.url(run.checkpoint("policy", version - 1))) / "hf",
                                                dtype=torch.float64)


def reference(run, trees: list[dict], decoupled: bool):
    behaviour_policy, policy = policy_of_version(run, 1), policy_of_version(run, 2)
    terms, tokens = [], 0
    for tree in trees:
        rewards = torch.tensor([r for r, n in zip(tree["rewards"], tree["counts"]) for _ in range(n)],
                               dtype=torch.float64)
        advantages = iter((rewards - rewards.mean()) / (rewards.std() + 1e-6))
        for completion, n in zip(tree["completions"], tree["counts"]):
            logp = scored(policy, tree["prompt_ids"], completion)
            # pi_behaviour as the sampler reported it (AReaL's old_logprobs from the inference
            # engine): version 1's, in the float32 the sampler draws in.
            behaviour = torch.tensor(tree["logprobs"][tree["completions"].index(completion)], dtype=torch.float64)
            with torch.no_grad():
                assert torch.allclose(scored(behaviour_policy, tree["prompt_ids"], completion), behaviour, atol=1e-5)
            for _ in range(n):
                a = next(advantages)
                if decoupled:
                    proximal = logp.detach()
                    r = torch.exp(logp - proximal)
                    w = torch.exp(proximal - behaviour).clamp(max=CAP)
                    terms.append(-w * torch.minimum(r * a, r.clamp(1 - EPS, 1 + EPS) * a))
                else:
                    rho = torch.exp(logp - behaviour)
                    terms.append(-torch.minimum(rho * a, rho.clamp(1 - EPS, 1 + EPS) * a))
                tokens += len(completion)
    loss = torch.cat(terms).sum() / tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in policy.named_parameters()}


@pytest.mark.parametrize("decoupled", [False, True], ids=["behaviour", "decoupled"])
def test_a_step_on_stale_trees_equals_the_published_off_policy_loss(exact_rmsnorm, tiny_model_dir, tmp_path,
                                                                    monkeypatch, decoupled):
    policy, seen, trees, run = run_pipeline(tmp_path, tiny_model_dir, [f"algo.decoupled={decoupled}"], monkeypatch)
    loss, grads = reference(run, trees, decoupled)
    assert policy["trees_stale_dropped"] == 1 and policy["trees_left_out"] == 1
    assert policy["staleness_mean"] == 1 and policy["staleness_max"] == 1
    # The correction bites: some ratios are clipped, or some behaviour weights capped.
    assert policy["tis_capped_fraction" if decoupled else "clip_ratio/region_mean"] > 0
    assert policy["off_policy/staleness1/logprob_gap"] > 0 and "off_policy/staleness2/logprob_gap" not in policy
    assert_same_update(policy, seen, loss, grads)
    # The run's record of which version made each tree.
    shards = json.loads((tmp_path / "run/step_0001/trees/shard_00.json").read_text())["trees"]
    assert {t["policy_version"] for t in shards} == {sampling_version(run.cfg, 1)} == {0}


def test_asynchronous_rollouts_need_a_checkpoint_per_step_and_no_second_correction():
    assert [sampling_version(load_config(None, [f"rollout.max_staleness={k}"]), 5) for k in (0, 1, 2)] == [5, 4, 3]
    assert sampling_version(load_config(None, ["rollout.max_staleness=2"]), 1) == 0
    for bad, key in ((["rollout.max_staleness=1", "checkpoint.every=2"], "checkpoint.every"),
                     (["rollout.max_staleness=1", "algo.tis_cap=2"], "algo.tis_cap"),
                     (["algo.decoupled=true", "algo.tis_cap=2"], "algo.tis_cap"),
                     (["algo.behaviour_cap=0.5"], "algo.behaviour_cap"),
                     (["rollout.max_staleness=-1"], "rollout.max_staleness"),
                     (["pool.slots=2", "pool.rollout_devices=[0,1]"], "pool.rollout_devices"),
                     (["pool.slots=2", "pool.rollout_devices=[2]"], "pool.rollout_devices")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, bad)
