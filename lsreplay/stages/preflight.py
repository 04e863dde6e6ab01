"""What is checked before a run's first stage (`lsreplay train`, `lsreplay config --check`
and the flow call it): every input a stage will read, so that a bad one fails at once with a
message that says what to do, not after the first steps."""

from __future__ import annotations

import math
import posixpath

import torch

from lsreplay.core.config import Config, ConfigError, completion_tokens, multi_turn
from lsreplay.core.devices import check_accelerator
from lsreplay.core.run import Run
from lsreplay.data.chat_formats import Chat
from lsreplay.data.environments import Calls, Episodes, load_play
from lsreplay.data.preferences import check_preferences, offline
from lsreplay.data.prompt_sets import check_prompts
from lsreplay.data.rendering import render_prompt
from lsreplay.data.rewards import Reward
from lsreplay.drafter.export import exported_format
from lsreplay.drafter.model import FORMAT
from lsreplay.metrics.trackers import check_trackers
from lsreplay.models.families import family
from lsreplay.models.loading import check_positions, check_weights, hf_config, load_tokenizer, resolve_model_dir
from lsreplay.models.lora import check_lora
from lsreplay.planning.plan import model_dims
from lsreplay.planning.shape import TreeShape
from lsreplay.planning.update import kept_view, planned_split
from lsreplay.rollout.vllm_engine import check_engine


def preflight(cfg: Config, force: bool = False) -> Run:
    """What can be checked before any work: the store answers, the config fits an existing
    run, the model folder is there, of a family replay is exact on, and reaches the positions
    the prompts and completions need (model.rope_scaling), the trackers are installed, the reward functions import
    and take what the data gives them, the tools and environment import, and the prompts load, have the shape of prompts,
    split into training and held-out sets, can be scored and fit their token limit
    (lsreplay.data.prompt_sets.check_prompts), and the replay backward fits its budget.
    Raises ConfigError, StorageError, ModelError or DatasetError with a message that says what to do. Returns the run with its thread count
    pinned (`Run.with_pinned_threads`)."""
    run = Run(cfg)
    run.check_config(force)
    if cfg.pool.task_runner == "thread":  # under Ray the devices are the workers', checked there
        check_accelerator(cfg.pool)
    model_dir = resolve_model_dir(cfg.model)
    if not cfg.model.arch:  # a random model of that shape otherwise, no weights
        check_weights(model_dir)
    family(hf_config(cfg.model))  # replay is exact on it, or it is refused here
    completion = completion_tokens(cfg.rollout)
    check_positions(cfg.model, cfg.data.max_prompt_tokens + completion,
                    f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + {completion} completion tokens")
    check_lora(cfg.model)
    check_replay_budget(cfg)
    if cfg.rollout.engine == "vllm":
        check_engine(cfg, model_dir)
    if cfg.drafter.enabled:
        check_drafters(run)
    check_trackers(cfg)
    reward = Reward(cfg)  # the reward functions import and can be called in their styles
    tokenizer = load_tokenizer(cfg.model)
    if offline(cfg):  # the preference dataset trains; prompts only evaluate
        check_preferences(cfg, tokenizer)
    check_prompts(cfg, prompt_renderer(cfg, tokenizer), reward, training=not offline(cfg))
    return run.with_pinned_threads()


def check_replay_budget(cfg: Config) -> None:
    """The replay backward can run the config's largest trees (prompts at
    data.max_prompt_tokens, completions at their longest) within replay.budget_mb, as
    `lsreplay plan` decides it (memory.kept_spans): a ConfigError naming the budget it needs
    now, not at the first step's update."""
    if cfg.replay.mode == "replay":
        _, dims = model_dims(cfg, dict(cfg.model.arch))
        shape, accelerator = TreeShape.of_rollouts(cfg.data.max_prompt_tokens, cfg.rollout), cfg.pool.accelerator == "cuda"
        kept_view(dims, getattr(torch, cfg.model.dtype), shape, cfg.replay.budget_mb * 2**20 or None, accelerator,
                  cfg.replay.join_below, cfg.replay.offload_prefix, planned_split(cfg, dims, shape, accelerator))


def prompt_renderer(cfg: Config, tokenizer):
    """How a prompt reaches the model: rendered alone, or for episodes as their opening (the
    environment's reset string added, the tools shown); loading the tools and environment
    checks they import and have schemas, and an instance reset with the prompt's row must fork."""
    if not multi_turn(cfg.rollout):
        return lambda prompt: render_prompt(tokenizer, prompt, cfg.data)
    play = load_play(cfg.rollout, cfg.sandbox)
    chat = Chat(tokenizer, play.schemas, cfg.data, [tokenizer.eos_token_id], play.format)  # end-of-turn: later turns

    def render(prompt):
        with Calls(play.timeout, 1) as calls:
            episodes = Episodes(play, chat, [prompt], calls)
            try:  # a reset instance forks (or the error names fork()), where the episodes branch
                if math.prod(cfg.rollout.branching) > 1:
                    episodes.close(episodes.branch(episodes.root(0), last=False))
                return episodes.prompt_ids()[0]
            finally:
                episodes.close(episodes.root(0))

    return render


def check_drafters(run: Run) -> None:
    """The run's drafters are of the architecture this lsreplay trains and vLLM loads (those of
    lsreplay before vLLM's EAGLE layout had an fc bias and an input norm, and load in neither)."""
    for key in run.store.list("checkpoints/drafter"):
        if key.endswith("/hf/config.json") and (found := exported_format(run.store, posixpath.dirname(key))) != FORMAT:
            raise ConfigError(f"{run.store.url(posixpath.dirname(key))} holds a drafter of format {found!r}, not "
                              f"{FORMAT!r} (an older lsreplay's): neither this lsreplay nor vLLM loads it; continue "
                              "in a new run_dir, or with drafter.enabled=false (--force)")
