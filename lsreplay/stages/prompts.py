"""Stage 1: sample this step's prompts (deterministic per seed and step)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from lsreplay import faults
from lsreplay.data import PromptSet, generate_prompt_file
from lsreplay.run import Run


def prompt_file(run: Run) -> Path:
    """The configured prompt file, or one generated offline with reasoning-gym."""
    d = run.cfg.data
    if d.path:
        return Path(d.path)
    spec = json.dumps([d.tasks, d.size, run.cfg.seed, d.task_args], sort_keys=True)
    name = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return generate_prompt_file(Path(".cache/prompts") / f"{name}.jsonl", list(d.tasks), d.size,
                                run.cfg.seed, dict(d.task_args))


def sample_prompts(run: Run, step: int) -> dict:
    if done := run.done(step, "prompts"):
        return done
    run.begin(step, "prompts")
    prompts = PromptSet.from_file(prompt_file(run)).sample(step, run.cfg.data.prompts_per_step, run.cfg.seed)
    entry = run.store.write_json(run.key(step, "prompts.json"),
                                 {"prompts": [dataclasses.asdict(p) for p in prompts]})
    faults.hook("prompts", step, "mid")
    return run.finish(step, "prompts", {"files": [entry], "count": len(prompts)})
