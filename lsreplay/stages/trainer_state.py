"""The run's state as a transformers.TrainerState: what TRL's GRPOTrainer passes reward
functions as `trainer_state` (its own self.state), for curricula and other rewards that
change with training."""

from __future__ import annotations

import math

from transformers import TrainerState

from lsreplay.core.run import Run


def trainer_state(run: Run, step: int) -> TrainerState:
    """The state while the policy after `step` updates acts (step `step`'s rollouts, or the
    evaluation after `step` updates): global_step = step updates done, of max_steps; the
    epoch, as the training rows that many steps' prompts cover; num_input_tokens_seen, the
    prompt and completion tokens of the samples of the steps before (TRL's num_tokens); and
    log_history, the run's metrics.jsonl lines of those steps."""
    cfg = run.cfg
    # The training set's size, as the prompts stage of this step (rollouts) or of the step
    # before (the evaluation that runs first) recorded it; none before step 0's.
    prompts = run.done(step, "prompts") or (run.done(step - 1, "prompts") if step else None) or {}
    steps_per_epoch = prompts["rows"] / cfg.data.prompts_per_step if prompts.get("rows") else None
    return TrainerState(
        global_step=step, max_steps=cfg.steps, logging_steps=1, eval_steps=cfg.eval.every,
        save_steps=cfg.checkpoint.every, train_batch_size=cfg.data.prompts_per_step * math.prod(cfg.rollout.branching),
        epoch=step / steps_per_epoch if steps_per_epoch else 0.0 if step == 0 else None,
        num_train_epochs=math.ceil(cfg.steps / steps_per_epoch) if steps_per_epoch else 0,
        num_input_tokens_seen=tokens_seen(run, step),
        log_history=[line for line in run.metrics() if line["step"] < step],
        is_local_process_zero=True, is_world_process_zero=True)


def tokens_seen(run: Run, step: int) -> int:
    """TRL's num_tokens before `step`: the prompt and completion tokens of the samples of the
    steps before, as the trees stage of the step before counted them (0 before step 0, or
    where that step's trees were written before trees counted tokens)."""
    before = run.done(step - 1, "trees") if step else None
    return (before or {}).get("num_tokens", 0)
