"""Edges of "scored as sampled" (docs/algorithms.md): the library's scoring functions and a
whole pipeline step under a tempered, truncated distribution.

- Every library function that scores tokens takes the distribution (a SamplingParams, or
  heads built from one) with no default: forgetting it is a TypeError, where it used to
  score the raw policy silently (the bug issue 31 removed from the stages, left in
  `ppo_update`, `kl.reference_logprobs` and `dpo.reference_sequence_logprobs`).
- `ppo_update` given a distribution steps along that distribution's gradient: one SGD step
  equals the one written here from a plain forward of each rollout, and not the raw one.
- A real two-step run on the HF engine at temperature 0.7, top-k and top-p: the sampler's
  behaviour logprobs, the caching pass's old logprobs and the reference's (the KL term's)
  are all of the tempered, truncated distribution; truncated importance sampling finds
  the trainer and the sampler agreeing; `entropy` is the sampled tokens' mean negative
  logprob under it (not TRL's and verl's entropy of the tempered untruncated distribution,
  which is far larger here: docs/algorithms.md, "KL and entropy").
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import RAW_LOGPROB
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from test_algos import small_trees, tiny_llama
from test_algorithms import run_steps

from lsreplay.algos.backward import (capture_logprobs, naive_logprobs, naive_loss_backward, naive_scores,
                                     replay_loss_backward)
from lsreplay.algos.critic import critic_heads
from lsreplay.algos.dpo import reference_sequence_logprobs
from lsreplay.algos.kl import reference_logprobs
from lsreplay.algos.ppo import ppo_update
from lsreplay.algos.updates import minibatch_updates
from lsreplay.models.distribution import RAW, SamplingParams, token_logprobs
from lsreplay.replay import naive_backward, replay_backward
from lsreplay.replay.capture import capture_rollouts, capture_tree
from lsreplay.replay.heads import LogprobHead
from lsreplay.replay.segments import target_logprobs
from lsreplay.stages.prefixes import activations_key
from lsreplay.tree import RolloutTree

TEMPERED = SamplingParams(temperature=0.7, top_p=0.9, top_k=8)


def zero_weights(trees):
    return [[torch.zeros(len(c), dtype=torch.float64) for c in t.completions] for t in trees]


def total_logprob(lp):
    return sum(x.sum() for row in lp for x in row)


# Each scoring function called as a caller that forgets the distribution would call it.
FORGETFUL = {
    "ppo_update": lambda m, t: ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.1), t,
                                          [[0.0] * len(x.completions) for x in t]),
    "reference_logprobs": lambda m, t: reference_logprobs(m, t),
    "reference_sequence_logprobs": lambda m, t: reference_sequence_logprobs(m, t),
    "naive_logprobs": lambda m, t: naive_logprobs(m, t),
    "naive_scores": lambda m, t: naive_scores(m, t),
    "capture_logprobs": lambda m, t: capture_logprobs(m, t),
    "capture_tree": lambda m, t: capture_tree(m, t[0]),
    "capture_rollouts": lambda m, t: capture_rollouts(m, t[0]),
    "replay_backward": lambda m, t: replay_backward(m, t, zero_weights(t)),
    "naive_backward": lambda m, t: naive_backward(m, t, zero_weights(t)),
    "replay_loss_backward": lambda m, t: replay_loss_backward(m, t, total_logprob),
    "naive_loss_backward": lambda m, t: naive_loss_backward(m, t, total_logprob),
    "minibatch_updates": lambda m, t: minibatch_updates(m, t, lambda idx: total_logprob, [[[0]]], lambda mb: None),
    "target_logprobs": lambda m, t: target_logprobs(m, torch.zeros(3, 32, dtype=torch.float64), [0, 1], [2, 3]),
    "token_logprobs": lambda m, t: token_logprobs(torch.zeros(2, 5), torch.tensor([0, 1])),
    "critic_heads": lambda m, t: critic_heads(),
    "LogprobHead": lambda m, t: LogprobHead(),
}


@pytest.mark.parametrize("name", sorted(FORGETFUL))
def test_forgetting_the_distribution_is_a_type_error(name):
    with pytest.raises(TypeError, match="sampling|heads|params"):
        FORGETFUL[name](tiny_llama(), small_trees())


def sgd_step_by_hand(base, trees, advantages, sampling: SamplingParams) -> dict[str, torch.Tensor]:
    """The parameter change of one SGD step (lr 1) on PPO's token-mean clipped surrogate at
    ratio 1, -sum A_j log p(y_jt) / tokens, each rollout's full sequence through the model,
    log p that of `sampling`'s distribution over its logits."""
    model = copy.deepcopy(base)
    terms, tokens = [], 0
    for tree, advs in zip(trees, advantages):
        for completion, a in zip(tree.completions, advs):
            ids = torch.tensor([tree.prompt_ids + completion])
            logits = model(input_ids=ids).logits[0, tree.prompt_len - 1:-1]
            terms.append(a * token_logprobs(logits, torch.tensor(completion), sampling).sum())
            tokens += len(completion)
    (-torch.stack(terms).sum() / tokens).backward()
    return {n: -p.grad for n, p in model.named_parameters()}


def test_ppo_update_steps_along_the_gradient_of_the_distribution_it_is_given():
    base, trees = tiny_llama(), small_trees()
    g = torch.Generator().manual_seed(0)
    advantages = [[float(torch.randn((), generator=g)) for _ in t.completions] for t in trees]
    model = copy.deepcopy(base)
    ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), trees, advantages, TEMPERED)
    moved = {n: p.detach() - dict(base.named_parameters())[n].detach() for n, p in model.named_parameters()}
    tempered, raw = (sgd_step_by_hand(base, trees, advantages, s) for s in (TEMPERED, RAW))
    worst = max(float((moved[n] - tempered[n]).abs().max() / tempered[n].abs().max()) for n in tempered)
    assert worst <= 1e-6
    assert max(float((tempered[n] - raw[n]).abs().max() / raw[n].abs().max()) for n in raw) > 1e-2


def test_the_reference_is_scored_under_the_distribution_it_is_given():
    model, trees = tiny_llama(), small_trees()
    tempered = reference_logprobs(model, trees, TEMPERED)
    by_hand = naive_logprobs(model, trees, TEMPERED)
    raw, _ = capture_logprobs(model, trees, keep_kv=False, heads=RAW_LOGPROB)
    for t, h, r in zip(tempered, by_hand, raw):
        for a, b, c in zip(t, h, r):
            assert torch.allclose(a, b.detach(), rtol=0, atol=1e-10) and not torch.allclose(a, c, atol=1e-3)
    sequences = reference_sequence_logprobs(model, trees, TEMPERED)
    assert all(torch.allclose(s, torch.stack([x.sum() for x in t])) for s, t in zip(sequences, tempered))


TRUNCATED = ["rollout.temperature=0.7", "rollout.top_k=3", "rollout.top_p=0.8"]


def teacher_forced(model, record: dict, completion: list[int], sampling: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([record["prompt_ids"] + completion])).logits[0].double()
    return token_logprobs(logits[len(record["prompt_ids"]) - 1:-1], torch.tensor(completion), sampling)


def test_a_whole_step_on_the_hf_engine_scores_the_tempered_truncated_distribution(tiny_model_dir, tmp_path):
    """Step 1 (after an update): behaviour, old and reference logprobs of its trees against a
    plain forward of the step-0 checkpoint's policy and of the base, under the truncated
    distribution; the KL term reads the last two, truncated importance sampling the first two."""
    from flowrun import tree_records

    run, m = run_steps(tmp_path, tiny_model_dir, [*TRUNCATED, "algo.kl_coef=0.1", "algo.tis_cap=2",
                                                   "checkpoint.keep_step_data=true", "optim.lr=1e-2"], steps=2)
    sampling = SamplingParams(temperature=0.7, top_k=3, top_p=0.8)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / run.checkpoint("policy", 0) / "hf",
                                                  dtype=torch.float64).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    records = tree_records(tmp_path / "run", 1)
    for i, record in enumerate(records):
        acts = load_file(tmp_path / "run" / activations_key(run, 1, i))
        tree = RolloutTree.from_sequences(record["prompt_ids"], record["completions"])
        old, ref = tree.completion_values(acts["entry_logprobs"]), tree.completion_values(acts["ref_entry_logprobs"])
        for j, completion in enumerate(record["completions"]):
            behaviour = torch.tensor(record["logprobs"][j], dtype=torch.float64)
            acting = teacher_forced(policy, record, completion, sampling)
            assert torch.allclose(behaviour, acting, atol=1e-4) and torch.allclose(old[j], acting, atol=1e-4)
            assert torch.allclose(ref[j], teacher_forced(base, record, completion, sampling), atol=1e-4)
            assert not torch.allclose(acting, teacher_forced(policy, record, completion, RAW), atol=1e-2)
    assert m["policy"]["tis_capped_fraction"] == 0.0
    assert m["policy"]["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # entropy: the sampled tokens' mean -log p under the truncated distribution (each leaf
    # counted as the samples it stands for), far below TRL's and verl's figure, the exact
    # entropy of the tempered distribution over the whole vocabulary at each position
    counted = [(n, lps) for r in records for n, lps in zip(r["counts"], r["logprobs"])]
    estimate = -sum(n * sum(lps) for n, lps in counted) / sum(n * len(lps) for n, lps in counted)
    assert m["trees"]["entropy"] == pytest.approx(estimate, rel=1e-9)
    untruncated = torch.cat([untruncated_entropies(policy, r, c, sampling.temperature)
                             for r in records for c in r["completions"]]).mean()
    assert m["trees"]["entropy"] < math.log(3) < float(untruncated)


def untruncated_entropies(model, record: dict, completion: list[int], temperature: float) -> torch.Tensor:
    """TRL's and verl's entropy at each completion position: of softmax(logits / T) over the vocabulary."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([record["prompt_ids"] + completion])).logits[0].double()
    logp = (logits[len(record["prompt_ids"]) - 1:-1] / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
