"""Held-out evaluation of a policy: one greedy answer and `samples` sampled answers per
prompt, scored by the run's reward, summed up with 95% confidence intervals.

- accuracy: the share of prompts whose greedy answer is correct (reward >= 1), with the
  Wilson score interval of that binomial proportion over the prompts;
- sample_accuracy and reward: the share of sampled answers that are correct (pass@1 at the
  rollout temperature, what GRPO optimises) and their mean reward. A prompt's answers are
  not independent draws (an easy prompt gets many right), so their intervals are over
  prompts: the normal interval of the mean of the per-prompt means.

An answer no reward function applies to (reward None, TRL's unscorable) is left out of
every figure, as TRL leaves it out of its reward means; `unscored` counts such greedy answers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from lsreplay.data.rewards import CORRECT, Reward
from lsreplay.data.sources import Prompt
from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.tree_sampler import sample_trees

Z95 = 1.959963984540054


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sound near 0 and 1, unlike p +- z·se)."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float]:
    """mean +- z · standard error, within the values' range (0 wide for fewer than two values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean
    half = z * statistics.stdev(values) / math.sqrt(len(values))
    return max(min(values), mean - half), min(max(values), mean + half)


def answer(model, prompt_ids: list[list[int]], answers: int, params: SamplingParams, max_new_tokens: int,
           eos: list[int], generators: list[torch.Generator], rows: int,
           progress: Callable[[int], None] | None = None) -> list[list[list[int]]]:
    """`answers` completions of each prompt (token ids), prompts batched so that a batch
    decodes at most `rows` sequences (at least one prompt)."""
    per_batch = max(1, rows // answers)
    out = []
    for start in range(0, len(prompt_ids), per_batch):
        batch = slice(start, start + per_batch)
        trees, _ = sample_trees(model, prompt_ids[batch], [answers], [], max_new_tokens, params, eos,
                                generators[batch], progress)
        out += [t.completions for t in trees]
    return out


def score_answers(prompts: list[Prompt], greedy: list[tuple[str, list[int]]],
                  sampled: list[list[tuple[str, list[int]]]], reward: Reward,
                  state) -> tuple[list[dict], dict[str, list[float]]]:
    """One record per prompt: its greedy and sampled answers ((text, token ids) each) and
    their rewards; and what the reward functions gave log_metric. `state`: the
    transformers.TrainerState reward functions get."""
    best = reward.score(prompts, [[t] for t, _ in greedy], [[c] for _, c in greedy], state)
    rewards, logged = [[] for _ in prompts], {name: list(vs) for name, vs in best.metrics.items()}
    if any(sampled):
        scores = reward.score(prompts, [[t for t, _ in s] for s in sampled], [[c for _, c in s] for s in sampled],
                              state)
        rewards = scores.totals
        for name, values in scores.metrics.items():
            logged.setdefault(name, []).extend(values)
    records = [{"prompt_index": p.index, "question": p.question, "answer": p.answer, "greedy": g[0],
                "greedy_reward": b[0], "samples": [t for t, _ in s], "sample_rewards": r}
               for p, g, b, s, r in zip(prompts, greedy, best.totals, sampled, rewards)]
    return records, logged


def summary(records: list[dict]) -> dict:
    """Accuracy of the greedy answers and mean reward of the sampled ones, with intervals,
    over the answers a reward function scored."""
    greedy = [r["greedy_reward"] for r in records if r["greedy_reward"] is not None]
    correct = sum(v >= CORRECT for v in greedy)
    out = {"prompts": len(records), "unscored": len(records) - len(greedy),
           "accuracy": correct / len(greedy) if greedy else 0.0,
           "greedy_reward": statistics.fmean(greedy) if greedy else 0.0}
    out["accuracy_lo"], out["accuracy_hi"] = wilson_interval(correct, len(greedy))
    rewards = [x for x in ([v for v in r["sample_rewards"] if v is not None] for r in records) if x]
    if rewards:
        for key, per_prompt in (("reward", [statistics.fmean(x) for x in rewards]),
                                ("sample_accuracy", [statistics.fmean(v >= CORRECT for v in x) for x in rewards])):
            out[key] = statistics.fmean(per_prompt)
            out[f"{key}_lo"], out[f"{key}_hi"] = mean_interval(per_prompt)
    return out
