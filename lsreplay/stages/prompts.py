"""Stage 1: sample this step's prompts (deterministic per seed and step) from the training
set: the prompt source less the held-out questions (lsreplay.data.prompt_sets).

With dynamic sampling (algo.dynamic_sampling) the stage also draws, in advance, the
replacements the rollouts may need: one more batch per further round of draws (`reserve`),
so every prompt a step can train on is decided here, before any rollout, and a resumed
step draws the same. Offline DPO (algo.dpo_source=dataset) samples rows of the preference
dataset instead (`preferences`)."""

from __future__ import annotations

import dataclasses

from lsreplay.core import faults
from lsreplay.core.run import Run
from lsreplay.data.preferences import PreferenceSet, offline
from lsreplay.data.prompt_sets import training_prompts


def sample_prompts(run: Run, step: int) -> dict:
    if done := run.done(step, "prompts"):
        return done
    run.begin(step, "prompts")
    cfg = run.cfg
    n, a = cfg.data.prompts_per_step, cfg.algo
    if offline(cfg):
        source = PreferenceSet.from_file(cfg.data.path, cfg.data.split)
        content = {"preferences": [dataclasses.asdict(r) for r in source.sample(step, n, cfg.seed)]}
    else:
        source = training_prompts(cfg)
        content = {"prompts": [dataclasses.asdict(p) for p in source.sample(step, n, cfg.seed)]}
        if a.dynamic_sampling:
            content["reserve"] = [[dataclasses.asdict(p) for p in source.sample(step, n, cfg.seed, draw)]
                                  for draw in range(1, a.dynamic_sampling_draws)]
    entry = run.store.write_json(run.key(step, "prompts.json"), content)
    faults.hook("prompts", step, "mid")
    # rows: the training set's size, for the epoch reward functions see (stages.trainer_state).
    return run.finish(step, "prompts", {"files": [entry], "count": n, "rows": len(source)})
