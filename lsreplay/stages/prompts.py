"""Stage 1: sample this step's prompts (deterministic per seed and step) from the training
set: the prompt source less the held-out questions (lsreplay.prompt_sets)."""

from __future__ import annotations

import dataclasses

from lsreplay import faults
from lsreplay.prompt_sets import training_prompts
from lsreplay.run import Run


def sample_prompts(run: Run, step: int) -> dict:
    if done := run.done(step, "prompts"):
        return done
    run.begin(step, "prompts")
    prompts = training_prompts(run.cfg).sample(step, run.cfg.data.prompts_per_step, run.cfg.seed)
    entry = run.store.write_json(run.key(step, "prompts.json"),
                                 {"prompts": [dataclasses.asdict(p) for p in prompts]})
    faults.hook("prompts", step, "mid")
    return run.finish(step, "prompts", {"files": [entry], "count": len(prompts)})
