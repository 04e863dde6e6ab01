"""The evaluation stage: the policy that acts in `step` answers the fixed held-out prompts
(lsreplay.prompt_sets) greedily and `eval.samples` times sampled; the answers, their
rewards and the summary (lsreplay.evaluation) go to the store.

The stage of step s evaluates the policy after s updates: step 0 the base model, step
`steps` (a step folder of its own) the policy after the last update. It runs at steps 0,
eval.every, 2·eval.every, ... and `steps`, so a run extended later (--steps) keeps every
evaluation it made, and runs of one config compare point for point.
"""

from __future__ import annotations

import math
import time
from functools import partial

from tqdm.auto import tqdm

from lsreplay import faults
from lsreplay.evaluation import answer, score_answers, summary
from lsreplay.models import eos_ids, load_tokenizer
from lsreplay.prompt_sets import heldout_prompts
from lsreplay.rewards import Reward
from lsreplay.rollout.sampling import SamplingParams
from lsreplay.run import Run
from lsreplay.stages.common import policy_before
from lsreplay.stages.trees import render_prompt

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
    model, tokenizer, reward = policy_before(run, step), load_tokenizer(cfg.model), Reward(cfg)
    ids = [render_prompt(tokenizer, p, cfg.data.system_prompt, cfg.data.max_prompt_tokens) for p in prompts]
    r, samples = cfg.rollout, cfg.eval.samples
    # A batch decodes as many sequences as a training step's rollouts, which the config sized to fit.
    rows, eos = cfg.data.prompts_per_step * math.prod(r.branching), eos_ids(tokenizer, model)
    start = time.perf_counter()
    with tqdm(total=len(ids) * (1 + samples) * r.max_new_tokens, desc=f"step {step} eval", unit="tok",
              leave=False) as bar:
        greedy = answer(model, ids, 1, SamplingParams(temperature=0.0), r.max_new_tokens, eos,
                        [run.generator(step, STAGE, i) for i in range(len(ids))], rows, bar.update)
        sampled = answer(model, ids, samples, SamplingParams(r.temperature, r.top_p, r.top_k), r.max_new_tokens,
                         eos, [run.generator(step, STAGE, i) for i in range(len(ids))], rows,
                         bar.update) if samples else [[] for _ in ids]
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    records = score_answers(prompts, [decode(c[0]) for c in greedy], [[decode(s) for s in c] for c in sampled],
                            reward)
    entry = run.store.write_json(run.key(step, "eval.json"), {"answers": records})
    faults.hook(STAGE, step, "mid")  # answers written, no done marker
    return run.finish(step, STAGE, {"files": [entry], "devices": devices, "samples": samples,
                                    "seconds": time.perf_counter() - start, **summary(records)})
