"""Which prompts a run trains on, and which it holds out for evaluation.

With evaluation on (eval.every > 0), the held-out set is `eval.size` prompts with distinct
questions: the first such rows of `eval.path` or of the split `eval.split` of a save_to_disk
DatasetDict (TRL's dataset_test_split), or rows of the training source chosen by a fixed
seed, so every run of a config evaluates the same prompts and two runs' curves compare
point for point. Training never samples a held-out question: rows whose question
equals one are left out of the training set. With evaluation off, training samples every row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lsreplay.core.config import Config, reward_specs
from lsreplay.data import long_context
from lsreplay.data.checkers import check_rows
from lsreplay.data.environments import environment_rewards
from lsreplay.data.rendering import rendered_ids
from lsreplay.data.rewards import Reward, unscorable_tasks
from lsreplay.data.sources import (REQUIRED_FIELDS, DatasetError, Prompt, PromptSet, generate_prompt_file, prompt_key,
                                   task_args_for)
from lsreplay.models.loading import load_tokenizer, resolve_model_dir

# The held-out rows depend on the prompt file only, never on the run's seed.
HELDOUT_SEED = 15
# Prompts rendered before the run starts, the longest questions first: tokens follow
# characters closely enough that a prompt over data.max_prompt_tokens is among them.
LONGEST_CHECKED = 16


def prompt_file(cfg: Config) -> Path:
    """The configured prompt file (or folder), or one generated offline with reasoning-gym
    and lsreplay's long-context task (its prompts as long as the run renders them)."""
    d = cfg.data
    if d.path:
        return Path(d.path)
    task_args = task_args_for(list(d.tasks), dict(d.task_args))
    measure = None
    for name in set(d.tasks) & set(long_context.TASKS):
        task_args[name] = long_context.task_args(name, task_args.get(name, {}), d.max_prompt_tokens)
        measure = prompt_measure(cfg)
    spec = json.dumps([d.tasks, d.size, cfg.seed, task_args, *([measure.key] if measure else [])], sort_keys=True)
    name = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return generate_prompt_file(Path(".cache/prompts") / f"{name}.jsonl", list(d.tasks), d.size, cfg.seed, task_args,
                                measure)


def prompt_measure(cfg: Config) -> long_context.PromptMeasure:
    """How many tokens a generated question takes once the run renders it: the model's
    tokenizer, with what data adds (system prompt, examples, answer instruction, template)."""
    d = cfg.data
    tokenizer = load_tokenizer(cfg.model)
    added = [d.chat_template, d.system_prompt, d.example_messages, d.answer_instruction, d.chat_template_kwargs]
    key = json.dumps([str(resolve_model_dir(cfg.model)), type(tokenizer).__name__, len(tokenizer), added],
                     sort_keys=True)
    return long_context.PromptMeasure(
        key, lambda question: len(rendered_ids(tokenizer, Prompt(0, "", question, "", {}), d)))


def checked_by_reasoning_gym(cfg: Config) -> bool:
    """Whether reasoning-gym's checkers score the rollouts: no reward function is configured
    and no environment scores its episodes (get_reward)."""
    return not reward_specs(cfg.reward) and not environment_rewards(cfg.rollout)


def _open(cfg: Config, path: str | Path, columns: dict | None, split: str | None = None) -> PromptSet:
    # reasoning-gym's checkers need each row's answer and task; your own reward functions may not.
    required = REQUIRED_FIELDS if checked_by_reasoning_gym(cfg) else ("question",)
    return PromptSet.from_file(path, columns=columns, required=required, split=split or cfg.data.split)


def source_prompts(cfg: Config) -> PromptSet:
    """Every row of the training source (generated files use the standard column names)."""
    return _open(cfg, prompt_file(cfg), asdict(cfg.data.columns) if cfg.data.path else None)


def heldout_prompts(cfg: Config, source: PromptSet | None = None) -> PromptSet | None:
    """The fixed held-out set; None when evaluation is off."""
    e = cfg.eval
    if e.every == 0:
        return None
    if e.path or e.split:
        heldout = _open(cfg, _heldout_source(cfg), asdict(cfg.data.columns), e.split)
        rows, fix = _distinct(heldout, range(len(heldout)), e.size), "lower eval.size"
    else:
        heldout = source or source_prompts(cfg)
        rows = sorted(_distinct(heldout, np.random.default_rng(HELDOUT_SEED).permutation(len(heldout)), e.size))
        fix = "lower eval.size, or raise data.size"
    if len(rows) < e.size:
        raise DatasetError(f"{heldout.path}: {len(rows)} distinct questions, fewer than eval.size={e.size}; {fix}.")
    return heldout.select(rows)


def _heldout_source(cfg: Config) -> Path:
    """eval.path, else (eval.split) data.path: a folder datasets' save_to_disk wrote, whose
    split eval.split is."""
    source = cfg.eval.path or cfg.data.path
    if cfg.eval.split and not (source and Path(source).is_dir()):
        raise DatasetError(f"eval.split={cfg.eval.split!r} names a split of a folder datasets' save_to_disk wrote (a "
                           f"DatasetDict), but {source or 'the generated prompt file'!r} is none; give eval.path, a "
                           "file of held-out prompts, instead")
    return Path(source)


def training_prompts(cfg: Config) -> PromptSet:
    """The rows training samples from: the source less every held-out question."""
    source = source_prompts(cfg)
    heldout = heldout_prompts(cfg, source)
    if heldout is None:
        return source
    held = set(map(prompt_key, heldout.column("question")))
    rows = [r for r, q in zip(source.rows, source.column("question")) if prompt_key(q) not in held]
    if not rows:
        raise DatasetError(f"{source.path}: every question is held out for evaluation (eval.size={cfg.eval.size}), "
                           "none is left to train on; lower eval.size, add rows, or give eval.path.")
    return source.select(rows)


def _distinct(prompts: PromptSet, order: Iterable[int], size: int) -> list[int]:
    """The file rows of the first `size` prompts in `order` whose questions were not seen before."""
    questions = [prompt_key(q) for q in prompts.column("question")]
    seen, rows = set(), []
    for i in order:
        if len(rows) == size:
            break
        if questions[i] not in seen:
            seen.add(questions[i])
            rows.append(prompts.rows[i])
    return rows


def check_prompts(cfg: Config, render, reward: Reward, training: bool = True) -> None:
    """Every data problem a config can show, before any work: the source loads (generated
    first if need be), the held-out set and the training set are there, every row's prompt is
    a string or chat messages, the reward functions take what the data gives them, every task
    the default reward must score is a reasoning-gym task, and the longest prompts fit
    data.max_prompt_tokens once `render`ed (render(prompt) -> token ids); a row whose task's
    checker evaluates it is one lsreplay generated (lsreplay.data.checkers). training=False:
    the held-out set only (offline DPO trains on a preference dataset)."""
    sets = ([training_prompts(cfg)] if training else []) + [s for s in [heldout_prompts(cfg)] if s is not None]
    for prompts in sets:
        try:
            prompts.check_prompts()
        except DatasetError as e:
            raise DatasetError(f"{prompts.path}: {e}") from None
        reward.check_columns(prompts.reward_columns(), environments=bool(cfg.rollout.environment))
    if checked_by_reasoning_gym(cfg):
        for prompts in sets:
            unknown = unscorable_tasks({str(t) for t in prompts.column("task")})
            if unknown:
                raise DatasetError(f"{prompts.path}: tasks {unknown[:5]} are not reasoning-gym tasks, so the default "
                                   "reward cannot score them; give reward.functions=[module:function], or fix "
                                   f"the column data.columns.task={cfg.data.columns.task!r} names.")
            try:  # a checker that evaluates its row gets only rows lsreplay generated
                check_rows(cfg, prompts)
            except DatasetError as e:
                raise DatasetError(f"{prompts.path}: {e}") from None
    for prompts in sets:
        lengths = [len(prompt_key(q or "")) for q in prompts.column("question")]
        for i in sorted(range(len(prompts)), key=lambda i: -lengths[i])[:LONGEST_CHECKED]:
            try:
                render(prompts[i])
            except DatasetError as e:  # names the prompt and the limit; add the file
                raise DatasetError(f"{prompts.path}: {e}") from None
