"""The evaluation stage: the policy that acts in `step` answers the fixed held-out prompts
(lsreplay.data.prompt_sets) greedily and `eval.samples` times sampled; the answers, their
rewards and the summary (lsreplay.data.evaluation) go to the store.

The stage of step s evaluates the policy after s updates: step 0 the base model, step
`steps` (a step folder of its own) the policy after the last update. It runs at steps 0,
eval.every, 2·eval.every, ... and `steps`, so a run extended later (--steps) keeps every
evaluation it made, and runs of one config compare point for point.
"""

from __future__ import annotations

import math
import time

from tqdm.auto import tqdm

from lsreplay.core import faults
from lsreplay.core.run import Run
from lsreplay.data.evaluation import answer, score_answers, summary
from lsreplay.data.prompt_sets import heldout_prompts
from lsreplay.data.rendering import render_prompt
from lsreplay.data.rewards import Reward
from lsreplay.models.distribution import SamplingParams
from lsreplay.models.loading import eos_ids, load_tokenizer
from lsreplay.stages.common import StateClock, policy_before
from lsreplay.stages.trainer_state import trainer_state

STAGE = "eval"


def evaluated(cfg, step: int) -> bool:
    """Whether the run evaluates the policy of `step` (after `step` updates)."""
    every = cfg.eval.every
    return every > 0 and (step % every == 0 or step == cfg.steps)


def evaluate_policy(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool slot this stage holds (recorded)."""
    if done := run.done(step, STAGE):
        return done
    run.begin(step, STAGE)
    cfg = run.cfg
    prompts = heldout_prompts(cfg)
    prompts = [prompts[i] for i in range(len(prompts))]
    device, clock = run.device(devices), StateClock()
    model, tokenizer, reward = clock(policy_before, run, step, device), load_tokenizer(cfg.model), Reward(cfg, device)
    ids = [render_prompt(tokenizer, p, cfg.data) for p in prompts]
    r, samples = cfg.rollout, cfg.eval.samples
    # A batch decodes as many sequences as a training step's rollouts, which the config sized to fit.
    rows, eos = cfg.data.prompts_per_step * math.prod(r.branching), eos_ids(tokenizer, model)
    start = time.perf_counter()
    with tqdm(total=len(ids) * (1 + samples) * r.max_new_tokens, desc=f"step {step} eval", unit="tok",
              leave=False) as bar:

        def answers(count: int, params: SamplingParams) -> list[list[tuple[str, list[int]]]]:
            """`count` answers per prompt: (text, token ids)."""
            generators = [run.generator(step, STAGE, i, device=device) for i in range(len(ids))]
            completions = answer(model, ids, count, params, r.max_new_tokens, eos, generators, rows, bar.update)
            return [[(tokenizer.decode(c, skip_special_tokens=True), c) for c in cs] for cs in completions]

        greedy = [a[0] for a in answers(1, SamplingParams(temperature=0.0))]
        sampled = answers(samples, SamplingParams(r.temperature, r.top_p, r.top_k)) if samples else [[] for _ in ids]
    records, logged = score_answers(prompts, greedy, sampled, reward, trainer_state(run, step))
    tokens = sum(len(c) for _, c in greedy) + sum(len(c) for s in sampled for _, c in s)
    entry = run.store.write_json(run.key(step, "eval.json"), {"answers": records})
    faults.hook(STAGE, step, "mid")  # answers written, no done marker
    return run.finish(step, STAGE, {"files": [entry], "devices": devices, "device": str(device), "samples": samples,
                                    "seconds": time.perf_counter() - start, "state_seconds": clock.seconds,
                                    "tokens_per_s": tokens / (time.perf_counter() - start),
                                    "logged": {name: sum(vs) / len(vs) for name, vs in logged.items()},
                                    **summary(records)})
