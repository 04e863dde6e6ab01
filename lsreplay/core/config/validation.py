"""Value checks the types cannot express, one function per section, run in a fixed order by
`validate`; a check that ties sections together sits with the key it names. Every error
names the key, its value and what is allowed, and is raised before any work starts."""

from __future__ import annotations

import math

from lsreplay.core.config.data import EXAMPLE_ROLES, PROMPT_TRUNCATIONS, REWARD_STYLES, EvalConfig, RewardConfig, \
    is_import_path, is_reward_model, reward_specs
from lsreplay.core.config.model import ALL_LINEAR, DTYPES, PROJECTIONS, ROPE_SCALINGS
from lsreplay.core.config.rollout import BRANCH_AT, ENGINES, TOOL_CALL_FORMATS, VLLM_MAX_LORA_RANK, DrafterConfig, \
    multi_turn
from lsreplay.core.config.runtime import ACCELERATORS, TRACKERS, CheckpointConfig, SandboxConfig, StorageConfig, \
    tracker_install_hint
from lsreplay.core.config.schema import Config, ConfigError
from lsreplay.core.config.training import ADVANTAGES, ALGOS, DPO_SOURCES, DYNAMIC_SAMPLING_METRICS, KL_ESTIMATORS, \
    LOSS_AGGS, OVERLONG, SCALE_REWARDS, SCHEDULES, TREE_BASELINES, OptimConfig, ReplayConfig


def _check(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r} is not allowed: {allowed}")


def validate(cfg: Config) -> None:
    """Every section's checks, in the order they have always run (the first failure is the one reported)."""
    _validate_run(cfg)
    _validate_model(cfg)
    _validate_data(cfg)
    _validate_eval(cfg.eval)
    _validate_reward(cfg.reward)
    _validate_rollout(cfg)
    _validate_algo(cfg)
    _validate_optim(cfg.optim)
    _validate_drafter(cfg.drafter)
    _validate_replay(cfg.replay)
    _validate_context_parallel(cfg)
    _validate_checkpoint(cfg.checkpoint)
    _validate_staleness(cfg)
    _validate_pool(cfg)
    _validate_tracking(cfg)
    _validate_limits(cfg)
    _validate_sandbox(cfg.sandbox)
    _validate_storage(cfg.storage)


def _validate_run(cfg: Config) -> None:
    """The top-level keys."""
    _check(cfg.steps >= 1, "steps", "must be >= 1", cfg.steps)
    _check(cfg.threads >= 0, "threads", "must be >= 0 (0 = this machine's count, recorded with the run)",
           cfg.threads)


def _validate_model(cfg: Config) -> None:
    _check(cfg.model.dtype in DTYPES, "model.dtype", f"one of {', '.join(DTYPES)}", cfg.model.dtype)
    _validate_rope_scaling(cfg.model.rope_scaling)
    _check(not cfg.model.rope_scaling or cfg.rollout.engine == "hf", "model.rope_scaling", "empty with "
           "rollout.engine=vllm: the engine loads model.path's own config; give a model folder whose config.json "
           "scales its positions (rope_parameters) instead", cfg.model.rope_scaling)
    _validate_lora(cfg)


def _validate_rope_scaling(scaling: dict) -> None:
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    _check(kind in ROPE_SCALINGS, "model.rope_scaling", "empty, or HF's rope parameters with rope_type "
           + ", ".join(ROPE_SCALINGS) + " (e.g. {rope_type: yarn, factor: 4}); dynamic and longrope change their "
           "frequencies with the sequence's length, which replay cannot reproduce", scaling)
    factor = scaling.get("factor")
    _check(isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor >= 1, "model.rope_scaling",
           "a factor >= 1 next to its rope_type (the positions reached are the model's times factor)", scaling)


def _validate_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    if not lora.enabled:
        return
    _check(lora.rank >= 1, "model.lora.rank", "an integer >= 1 (the adapters' rank, e.g. 16); to train the full "
           "weights instead set model.lora.enabled=false", lora.rank)
    _check(lora.alpha > 0, "model.lora.alpha", "a number > 0 (the adapters are scaled by alpha / rank)", lora.alpha)
    _check(lora.dropout == 0, "model.lora.dropout", "0: branch replay differentiates exactly the forward its "
           "caching pass computed, so nothing drops out (TRL's lora_dropout has no place here)", lora.dropout)
    _check(len(lora.target_modules) >= 1 and all(isinstance(m, str) and m for m in lora.target_modules),
           "model.lora.target_modules", f"a non-empty list of linear layers' names, e.g. {PROJECTIONS} or "
           "self_attn.q_proj (as PEFT matches them), or all-linear", lora.target_modules)
    _check(ALL_LINEAR not in lora.target_modules or len(lora.target_modules) == 1, "model.lora.target_modules",
           "all-linear alone (it adapts every linear layer of the decoder layers), or a list of names",
           lora.target_modules)
    _check(cfg.rollout.engine == "hf" or lora.rank <= VLLM_MAX_LORA_RANK, "model.lora.rank",
           f"at most {VLLM_MAX_LORA_RANK} with rollout.engine=vllm (the largest adapter vLLM serves)", lora.rank)
    _check(not cfg.replay.fsdp, "replay.fsdp", "false with model.lora.enabled=true: the adapters are small enough "
           "to replicate on every rank (plain data parallel)", cfg.replay.fsdp)


def _validate_data(cfg: Config) -> None:
    d, e = cfg.data, cfg.eval
    _check(d.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1", d.prompts_per_step)
    # Held out from the generated prompts, the eval set leaves the rest to training.
    held_out = e.size if e.every > 0 and not e.path else 0
    _check(d.size >= d.prompts_per_step + held_out or bool(d.path), "data.size",
           "must be >= data.prompts_per_step" + (f" + eval.size = {d.prompts_per_step + held_out}" if held_out else ""),
           d.size)
    _check(len(d.tasks) >= 1 or bool(d.path), "data.tasks", "at least one reasoning-gym task", d.tasks)
    _check(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", "an integer >= 1", d.max_prompt_tokens)
    _check(d.prompt_truncation in PROMPT_TRUNCATIONS, "data.prompt_truncation",
           " or ".join(PROMPT_TRUNCATIONS) + " (where an overlong prompt's own text is cut)", d.prompt_truncation)
    for name in ("question", "answer", "task"):
        _check(bool(getattr(d.columns, name)), f"data.columns.{name}", "a column name", getattr(d.columns, name))
    for i, message in enumerate(d.example_messages):
        _check(isinstance(message, dict) and message.get("role") in EXAMPLE_ROLES
               and isinstance(message.get("content"), str), f"data.example_messages[{i}]",
               "a chat message {role: " + ", ".join(EXAMPLE_ROLES) + ", content: its text}", message)


def _validate_eval(e: EvalConfig) -> None:
    _check(e.every >= 0, "eval.every", "must be >= 0 (0 = no evaluation)", e.every)
    _check(e.size >= 1, "eval.size", "must be >= 1 held-out prompt", e.size)
    _check(e.samples >= 0, "eval.samples", "must be >= 0 (0 = greedy answers only)", e.samples)


def _validate_reward(r: RewardConfig) -> None:
    _check(not (r.function and r.functions), "reward.function", "empty when reward.functions is given (it is the "
           "older key for one function: list it in reward.functions instead)", r.function)
    specs = reward_specs(r)
    for i, spec in enumerate(specs):
        key = f"reward.functions[{i}]" if r.functions else "reward.function"
        _check(is_reward_model(spec) or is_import_path(spec), key, "an import path: module.function or "
               "module:function (e.g. my_rewards:exact_match), or path/to/file.py:function; or a reward model's "
               "folder or model id", spec)
    _check(not r.weights or len(r.weights) == len(specs), "reward.weights",
           f"one weight per reward function ({len(specs)}), or empty (1 each)", r.weights)
    _check(all(math.isfinite(w) for w in r.weights), "reward.weights", "finite numbers", r.weights)
    _check(not r.styles or len(r.styles) == len(specs), "reward.styles",
           f"one style per reward function ({len(specs)}), or empty (each told by its parameters)", r.styles)
    for style in r.styles:
        _check(style in REWARD_STYLES, "reward.styles", " or ".join(REWARD_STYLES), style)
    _check(not r.kwargs or len(r.kwargs) == len(specs), "reward.kwargs",
           f"one dict of keywords per reward function ({len(specs)}), or empty (none)", r.kwargs)
    _check(r.timeout_seconds >= 0, "reward.timeout_seconds", "must be >= 0 (0 = no limit)", r.timeout_seconds)


def _validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    _check(len(r.branching) >= 1 and all(b >= 1 for b in r.branching), "rollout.branching",
           "a non-empty list of fan-outs >= 1", r.branching)
    # GRPO learns from the differences between a prompt's rollouts: with one rollout, or
    # identical ones, every advantage is 0 and a run would train for hours and change nothing.
    _check(math.prod(r.branching) >= 2, "rollout.branching", "at least 2 rollouts per prompt (the product of "
           "the fan-outs): GRPO's advantages compare a prompt's rollouts, so one alone trains nothing", r.branching)
    _validate_episodes(cfg)
    if r.branch_at == "tokens":
        _check(len(r.segment_tokens) == len(r.branching) - 1, "rollout.segment_tokens",
               f"exactly len(rollout.branching) - 1 = {len(r.branching) - 1} values", r.segment_tokens)
    _check(all(s >= 1 for s in r.segment_tokens) and sum(r.segment_tokens) < r.max_new_tokens,
           "rollout.segment_tokens", "values >= 1 summing to less than rollout.max_new_tokens", r.segment_tokens)
    _check(r.temperature > 0, "rollout.temperature", "must be > 0: greedy rollouts of a prompt are all the same "
           "answer, so GRPO's advantages are all 0 and nothing trains", r.temperature)
    _check(0 < r.top_p <= 1, "rollout.top_p", "in (0, 1]", r.top_p)
    _check(r.top_k == 0 or r.top_k >= 2, "rollout.top_k", "0 (no cut) or >= 2: top_k = 1 is greedy, so a "
           "prompt's rollouts are all the same and nothing trains", r.top_k)
    _check(1 <= r.shards <= cfg.data.prompts_per_step, "rollout.shards",
           f"between 1 and data.prompts_per_step = {cfg.data.prompts_per_step}", r.shards)
    _check(r.spec_threshold >= 0, "rollout.spec_threshold", "must be >= 0 (0 = no speculative decoding)",
           r.spec_threshold)
    _check(len(r.draft_lens) >= 1 and min(r.draft_lens) >= 0 and len(set(r.draft_lens)) == len(r.draft_lens),
           "rollout.draft_lens", "distinct draft lengths >= 0", r.draft_lens)
    _check(r.engine in ENGINES, "rollout.engine", " or ".join(ENGINES), r.engine)
    if r.engine == "vllm":
        _validate_vllm(cfg)


def _validate_vllm(cfg: Config) -> None:
    """rollout.vllm, and what the vLLM engine cannot run."""
    r = cfg.rollout
    _check(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype", "float32 or bfloat16 with "
           "rollout.engine=vllm (vLLM has no float64)", cfg.model.dtype)
    _check(r.vllm.kv_cache_gb > 0 or cfg.pool.accelerator == "cuda", "rollout.vllm.kv_cache_gb",
           "> 0 on a CPU pool (the engine's KV cache in host memory, GiB)", r.vllm.kv_cache_gb)
    _check(0 < r.vllm.gpu_memory_utilization < 1, "rollout.vllm.gpu_memory_utilization", "in (0, 1)",
           r.vllm.gpu_memory_utilization)
    _check(r.vllm.logprob_gap_every >= 0, "rollout.vllm.logprob_gap_every", "must be >= 0 (steps between "
           "measurements of the engine's logprobs; 0 = never)", r.vllm.logprob_gap_every)
    _check(r.vllm.timeout_s > 0, "rollout.vllm.timeout_s", "> 0 (seconds each call to the engine may take)",
           r.vllm.timeout_s)
    # vLLM 0.32's CPU sampler cuts top-k alone without sorting (apply_top_k_only), which
    # takes the max of an empty tensor in a speculative step that drafted nothing.
    speculates = r.spec_threshold > 0 and max(r.draft_lens) > 0 and cfg.drafter.enabled
    _check(not (speculates and r.top_k and r.top_p == 1 and cfg.pool.accelerator == "cpu"), "rollout.top_k",
           "0, or with rollout.top_p < 1 too, while a CPU vLLM engine speculates: vLLM 0.32's CPU sampler fails "
           "on a top-k cut alone in a step that drafted nothing (or set rollout.spec_threshold=0)", r.top_k)
    # Run on CPU, vLLM 0.32's LoRA kernels fail in the first speculative step (an einsum
    # over a decode batch's rows against the step's tokens); not run on CUDA yet.
    _check(not (speculates and cfg.model.lora.enabled), "drafter.enabled",
           "false (or rollout.spec_threshold=0) with model.lora.enabled=true on rollout.engine=vllm: vLLM 0.32's "
           "LoRA kernels fail in a speculative step on CPU and the pair has not run on CUDA; train the adapters "
           "without the drafter, or on rollout.engine=hf, whose speculative tail drafts over them",
           cfg.drafter.enabled)


def _validate_episodes(cfg: Config) -> None:
    r = cfg.rollout
    _check(r.max_turns >= 1, "rollout.max_turns", "an integer >= 1 (1 = single-turn answers)", r.max_turns)
    _check(r.branch_at in BRANCH_AT, "rollout.branch_at", " or ".join(BRANCH_AT), r.branch_at)
    _check(r.tool_call_format in TOOL_CALL_FORMATS, "rollout.tool_call_format", " or ".join(TOOL_CALL_FORMATS),
           r.tool_call_format)
    _check(r.max_concurrent_episodes >= 0, "rollout.max_concurrent_episodes", "an integer >= 0 (episodes in flight "
           "at once in a shard; 0 = all)", r.max_concurrent_episodes)
    _check(r.max_environment_tokens >= 1, "rollout.max_environment_tokens", "an integer >= 1 (the most tokens one "
           "answer of the environment may add to an episode)", r.max_environment_tokens)
    _check(r.tool_timeout_seconds >= 0, "rollout.tool_timeout_seconds", ">= 0 (seconds a call of a tool or of the "
           "environment may take; 0 = no limit)", r.tool_timeout_seconds)
    for i, spec in enumerate(r.tools):
        _check(isinstance(spec, str) and is_import_path(spec), f"rollout.tools[{i}]", "an import path: "
               "module.function or module:function (e.g. lsreplay.data.agentic:calculator), or path/to/file.py:function",
               spec)
    _check(not r.environment or is_import_path(r.environment), "rollout.environment", "empty, or an import path "
           "of the environment class: module.Factory or module:Factory (e.g. lsreplay.data.agentic:ArithmeticFeedback)",
           r.environment)
    if r.branch_at == "turns":
        _check(not r.segment_tokens, "rollout.segment_tokens", "[] with rollout.branch_at=turns: episodes then fork "
               "at turn boundaries only (rollout.branching gives one fan-out per turn); set rollout.segment_tokens=[] "
               "or rollout.branch_at=tokens", r.segment_tokens)
        _check(len(r.branching) <= r.max_turns, "rollout.branching", f"at most rollout.max_turns = {r.max_turns} "
               "fan-outs with rollout.branch_at=turns (one per turn); raise rollout.max_turns or drop levels",
               r.branching)
    if multi_turn(r):
        # DAPO's penalty grows with the completion's length, which in an episode holds the
        # environment's tokens and every turn's reply.
        _check(cfg.algo.overlong != "penalty", "algo.overlong", "none or mask with multi-turn episodes: the soft "
               "overlong penalty measures a single answer's length against rollout.max_new_tokens", cfg.algo.overlong)


def _validate_algo(cfg: Config) -> None:
    a = cfg.algo
    _check(a.name in ALGOS, "algo.name", "one of " + ", ".join(ALGOS), a.name)
    _check(a.tree_baseline in TREE_BASELINES, "algo.tree_baseline", " or ".join(TREE_BASELINES), a.tree_baseline)
    _check(a.tree_baseline == "group" or cfg.rollout.branching[0] >= 2, "algo.tree_baseline",
           "independent needs rollout.branching[0] >= 2 (leaves of different first-level subtrees to compare "
           "with); set rollout.branching[0] >= 2 or algo.tree_baseline=group", a.tree_baseline)
    _check(a.loss_agg in LOSS_AGGS, "algo.loss_agg", " or ".join(LOSS_AGGS), a.loss_agg)
    _check(a.scale_rewards in SCALE_REWARDS, "algo.scale_rewards", "group, batch or none (true and false: group "
           "and none, as TRL takes them)", a.scale_rewards)
    _check(a.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator", " or ".join(KL_ESTIMATORS), a.kl_estimator)
    # k1 = log pi - log ref has the gradient grad log pi, whose expectation over the policy's
    # own samples is 0: as a loss term it pulls nowhere (docs/algorithms.md, "KL penalty").
    _check(a.kl_estimator != "k1" or a.kl_coef == 0, "algo.kl_estimator", "k3 (its gradient is that of KL(ref || pi)) "
           "or k2 (that of KL(pi || ref)) with algo.kl_coef > 0: k1's gradient, grad log pi, is 0 in expectation "
           "on-policy, so as a loss term it regularizes nothing", a.kl_estimator)
    _check(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0", a.kl_coef)
    _check(a.clip_eps > 0, "algo.clip_eps", "must be > 0 (the ratio's clip range, e.g. 0.2)", a.clip_eps)
    _check(a.clip_eps_high >= 0, "algo.clip_eps_high", "must be >= 0 (0 = algo.clip_eps)", a.clip_eps_high)
    _check(a.tis_cap == 0 or a.tis_cap >= 1, "algo.tis_cap", "0 (off) or a cap >= 1 on the importance weights "
           "(e.g. 2)", a.tis_cap)
    _validate_ppo(cfg)
    _validate_dpo(cfg)
    _validate_refinements(cfg)


def _validate_optim(o: OptimConfig) -> None:
    _check(0 < o.lr < math.inf, "optim.lr", "a finite number > 0", o.lr)
    _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 = no clipping)", o.grad_clip)
    _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    for key, beta in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        _check(0 <= beta < 1, key, "in [0, 1): AdamW's moment decay (1 makes its bias correction divide by zero)", beta)
    _check(o.schedule in SCHEDULES, "optim.schedule", " or ".join(SCHEDULES), o.schedule)
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0 (optimizer updates; 0 = no warmup)",
           o.warmup_steps)


def _validate_drafter(d: DrafterConfig) -> None:
    _check(0 < d.lr < math.inf, "drafter.lr", "a finite number > 0", d.lr)
    _check(d.batch_size >= 1, "drafter.batch_size", "must be >= 1", d.batch_size)
    _check(d.steps >= 1, "drafter.steps", "must be >= 1", d.steps)
    _check(d.checkpoint_every >= 1, "drafter.checkpoint_every", "must be >= 1", d.checkpoint_every)
    _check(d.max_len >= 2, "drafter.max_len", "must be >= 2 positions per path", d.max_len)


def _validate_replay(r: ReplayConfig) -> None:
    _check(r.mode in ("replay", "naive"), "replay.mode", "replay or naive", r.mode)
    _check(r.kv_offload in ("store", "host"), "replay.kv_offload", "store or host", r.kv_offload)
    _check(r.join_below >= 0, "replay.join_below", "must be >= 0 (0 = never join)", r.join_below)
    _check(r.budget_mb >= 0, "replay.budget_mb", "must be >= 0 (0 = automatic)", r.budget_mb)


def _validate_ppo(cfg: Config) -> None:
    a = cfg.algo
    _check(a.epochs >= 1, "algo.epochs", "must be >= 1", a.epochs)
    _check(1 <= a.minibatches <= cfg.data.prompts_per_step, "algo.minibatches",
           f"between 1 and data.prompts_per_step = {cfg.data.prompts_per_step} (a minibatch holds whole trees)",
           a.minibatches)
    several = a.epochs * a.minibatches > 1
    _check(a.name == "ppo" or not several, "algo.name", "ppo for several updates per batch (algo.epochs = "
           f"{a.epochs}, algo.minibatches = {a.minibatches}); {a.name} makes one", a.name)
    _check(cfg.pool.devices_per_step == 1 or not several, "pool.devices_per_step",
           "1 with several PPO updates per batch (algo.epochs x algo.minibatches > 1): the data-parallel update "
           "makes one per step", cfg.pool.devices_per_step)
    _check(a.advantage in ADVANTAGES, "algo.advantage", " or ".join(ADVANTAGES), a.advantage)
    _check(a.advantage == "group" or a.critic, "algo.advantage", "gae needs a critic to estimate values: set "
           "algo.critic=true (with algo.name=ppo), or algo.advantage=group", a.advantage)
    _check(a.name == "ppo" or not a.critic, "algo.critic", f"false with algo.name={a.name}: the critic trains "
           "with PPO (algo.name=ppo)", a.critic)
    for key, value in (("algo.gamma", a.gamma), ("algo.lam", a.lam)):
        _check(0 <= value <= 1, key, "in [0, 1]", value)
    _check(a.vf_coef > 0, "algo.vf_coef", "must be > 0 (the value loss's weight)", a.vf_coef)
    _check(a.value_clip >= 0, "algo.value_clip", "must be >= 0 (0 = no clip)", a.value_clip)
    _check(0 < a.value_lr < math.inf, "algo.value_lr", "a finite number > 0", a.value_lr)


def _validate_dpo(cfg: Config) -> None:
    a = cfg.algo
    _check(a.dpo_beta > 0, "algo.dpo_beta", "must be > 0", a.dpo_beta)
    _check(a.dpo_source in DPO_SOURCES, "algo.dpo_source", " or ".join(DPO_SOURCES), a.dpo_source)
    if a.name != "dpo":
        _check(a.dpo_source == "rollouts", "algo.dpo_source", f"rollouts with algo.name={a.name} (a preference "
               "dataset trains DPO: algo.name=dpo)", a.dpo_source)
        return
    _check(a.kl_coef == 0, "algo.kl_coef", "0 with algo.name=dpo: DPO's loss holds the reference already "
           "(algo.dpo_beta)", a.kl_coef)
    _check(a.tis_cap == 0, "algo.tis_cap", "0 with algo.name=dpo (it weights advantages; DPO has none)", a.tis_cap)
    if a.dpo_source != "dataset":
        return
    _check(bool(cfg.data.path), "data.path", "a preference dataset (prompt, chosen, rejected columns) with "
           "algo.dpo_source=dataset", cfg.data.path)
    # Offline DPO samples no rollouts: a key that only shapes rollouts would silently do nothing.
    for key, value, ok, fix in (
            ("rollout.engine", cfg.rollout.engine, cfg.rollout.engine == "hf", "hf"),
            ("rollout.shards", cfg.rollout.shards, cfg.rollout.shards == 1, "1"),
            ("drafter.enabled", cfg.drafter.enabled, not cfg.drafter.enabled, "false"),
            ("algo.dynamic_sampling", a.dynamic_sampling, not a.dynamic_sampling, "false"),
            ("algo.overlong", a.overlong, a.overlong == "none", "none"),
            ("rollout.max_turns", cfg.rollout.max_turns, cfg.rollout.max_turns == 1, "1"),
            ("rollout.tools", cfg.rollout.tools, not cfg.rollout.tools, "[]"),
            ("rollout.environment", cfg.rollout.environment, not cfg.rollout.environment, "empty")):
        _check(ok, key, f"{fix} with algo.dpo_source=dataset: offline DPO samples no rollouts, so this rollout "
               "key would do nothing", value)
    _check(cfg.eval.every == 0 or bool(cfg.eval.path), "eval.path", "a prompt file (question, answer, task "
           "columns) to evaluate on with algo.dpo_source=dataset: the preference dataset holds no answers to check",
           cfg.eval.path)


def _validate_refinements(cfg: Config) -> None:
    a = cfg.algo
    _check(a.dynamic_sampling_draws >= 1, "algo.dynamic_sampling_draws", "must be >= 1 (rounds of draws, the first "
           "included)", a.dynamic_sampling_draws)
    metric = a.dynamic_sampling_metric
    _check(metric in DYNAMIC_SAMPLING_METRICS[:2] or (metric.startswith("rewards/") and len(metric) > 8),
           "algo.dynamic_sampling_metric", " or ".join(DYNAMIC_SAMPLING_METRICS) + " (one reward function's values)",
           metric)
    _check(a.overlong in OVERLONG, "algo.overlong", " or ".join(OVERLONG), a.overlong)
    _check(a.overlong != "penalty" or 0 < a.overlong_buffer < cfg.rollout.max_new_tokens, "algo.overlong_buffer",
           f"between 1 and rollout.max_new_tokens - 1 = {cfg.rollout.max_new_tokens - 1} with algo.overlong=penalty "
           "(the tokens before the limit over which the penalty grows)", a.overlong_buffer)
    _check(a.overlong_penalty > 0, "algo.overlong_penalty", "must be > 0 (the penalty at max_new_tokens)",
           a.overlong_penalty)


def _validate_context_parallel(cfg: Config) -> None:
    """A prompt too long for one device: replay.context_parallel, the rollouts'
    rollout.vllm.tensor_parallel_size, and what the plan times them at."""
    r, p = cfg.replay, cfg.pool
    _check(r.context_parallel >= 1, "replay.context_parallel", "an integer >= 1 (1 = no prompt split over ranks)",
           r.context_parallel)
    _check(r.context_parallel_tokens >= 0, "replay.context_parallel_tokens", "must be >= 0 (0 = the prompts one "
           "device cannot replay within replay.budget_mb)", r.context_parallel_tokens)
    _check(r.context_parallel == 1 or p.devices_per_step % r.context_parallel == 0, "replay.context_parallel",
           f"a divisor of pool.devices_per_step = {p.devices_per_step} (groups of consecutive ranks of the update); "
           f"set pool.devices_per_step to a multiple of it", r.context_parallel)
    _check(r.context_parallel == 1 or r.mode == "replay", "replay.context_parallel", "1 with replay.mode=naive "
           "(the per-rollout backward runs whole rollouts)", r.context_parallel)
    tp = cfg.rollout.vllm.tensor_parallel_size
    _check(tp >= 1, "rollout.vllm.tensor_parallel_size", "an integer >= 1 (1 = a vLLM engine on one device)", tp)
    _check(tp == 1 or cfg.rollout.engine == "vllm", "rollout.vllm.tensor_parallel_size", "1 with rollout.engine=hf "
           "(the HF sampler decodes on one device; rollout.engine=vllm spreads one over several)", tp)
    dcp = cfg.rollout.vllm.decode_context_parallel_size
    _check(dcp >= 1 and tp % dcp == 0, "rollout.vllm.decode_context_parallel_size",
           f"an integer >= 1 dividing rollout.vllm.tensor_parallel_size = {tp} (1 = none)", dcp)
    _check(dcp == 1 or p.accelerator == "cuda", "rollout.vllm.decode_context_parallel_size",
           "1 with pool.accelerator=cpu (vLLM's CPU attention has no decode context parallelism)", dcp)
    _check(tp <= (len(p.rollout_devices) or p.slots), "rollout.vllm.tensor_parallel_size",
           f"at most the rollouts' devices ({len(p.rollout_devices) or p.slots}: pool.rollout_devices, or "
           "pool.slots): a rollout shard's engine spans that many", tp)
    _check(p.interconnect_gbps >= 0, "pool.interconnect_gbps", "must be >= 0 (0 = unknown)", p.interconnect_gbps)
    _check(p.device_tflops >= 0, "pool.device_tflops", "must be >= 0 (0 = unknown)", p.device_tflops)


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check(c.every >= 1, "checkpoint.every", "must be >= 1", c.every)
    _check(c.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0 = keep all)", c.keep_last)
    _check(c.hf_shard_gb > 0, "checkpoint.hf_shard_gb", "a size in GiB > 0", c.hf_shard_gb)
    _check(c.resident or c.every == 1, "checkpoint.resident",
           "true unless checkpoint.every = 1 (a stage that keeps nothing loads the previous step's checkpoint)",
           c.resident)


def _validate_staleness(cfg: Config) -> None:
    """rollout.max_staleness (asynchronous rollouts) and the off-policy correction of algo."""
    k, a = cfg.rollout.max_staleness, cfg.algo
    _check(k >= 0, "rollout.max_staleness", "an integer >= 0 (0 = synchronous steps)", k)
    _check(a.behaviour_cap == 0 or a.behaviour_cap > 1, "algo.behaviour_cap", "0 (uncapped) or a cap > 1 on the "
           "decoupled loss's behaviour weights (AReaL's behave_imp_weight_cap, e.g. 5)", a.behaviour_cap)
    _check(not (a.decoupled and a.name == "dpo"), "algo.decoupled", "false with algo.name=dpo (it reweights the "
           "clipped surrogate's advantages; DPO has none)", a.decoupled)
    _check(not (a.decoupled and a.tis_cap), "algo.tis_cap", "0 with algo.decoupled=true: the decoupled loss weights "
           "every token by its capped behaviour ratio already (algo.behaviour_cap)", a.tis_cap)
    if k == 0:
        return
    _check(not a.tis_cap or a.decoupled, "algo.tis_cap", "0 with rollout.max_staleness > 0: the loss's ratio is then "
           "against the behaviour policy's logprobs, which corrects for the rollout engine too; for truncated "
           "weights use algo.decoupled=true with algo.behaviour_cap", a.tis_cap)
    _check(a.dpo_source == "rollouts", "rollout.max_staleness", "0 with algo.dpo_source=dataset: offline DPO samples "
           "no rollouts", k)
    # A resume samples an unfinished step's rollouts with the version they were scheduled for.
    _check(cfg.checkpoint.every == 1, "checkpoint.every", "1 with rollout.max_staleness > 0: a resume samples the "
           "rollouts still to do with the policy version they were scheduled for, loaded from its checkpoint",
           cfg.checkpoint.every)


def _validate_pool(cfg: Config) -> None:
    p = cfg.pool
    _check(p.slots >= 1, "pool.slots", "must be >= 1", p.slots)
    _check(p.task_runner in ("thread", "ray"), "pool.task_runner", "thread or ray", p.task_runner)
    _check(p.accelerator in ACCELERATORS, "pool.accelerator", " or ".join(ACCELERATORS), p.accelerator)
    _check(p.ray_gpus >= 0, "pool.ray_gpus", "must be >= 0", p.ray_gpus)
    # Ray hides every GPU from an actor that asks for none: its stages would find no CUDA device.
    _check(p.ray_gpus > 0 or p.task_runner != "ray" or p.accelerator != "cuda", "pool.ray_gpus",
           "> 0 with pool.accelerator=cuda under pool.task_runner=ray (each device's Ray host asks Ray for "
           "its GPU: pool.ray_gpus=1)", p.ray_gpus)
    _check(p.device_memory_gb >= 0, "pool.device_memory_gb", "must be >= 0 (0 = unknown)", p.device_memory_gb)
    _check(p.host_memory_gb >= 0, "pool.host_memory_gb", "must be >= 0 (0 = unknown)", p.host_memory_gb)
    _check(0 <= p.devices_per_host <= p.slots, "pool.devices_per_host",
           f"between 0 (all on one host) and pool.slots = {p.slots}", p.devices_per_host)
    for key, value in (("pool.stage_timeout_seconds", p.stage_timeout_seconds), ("pool.wait_seconds", p.wait_seconds)):
        _check(value >= 0, key, "must be >= 0 (0 = no limit)", value)
    _check(1 <= p.devices_per_step <= p.slots, "pool.devices_per_step", f"between 1 and pool.slots = {p.slots}",
           p.devices_per_step)
    rollout = p.rollout_devices
    _check(all(0 <= d < p.slots for d in rollout) and len(set(rollout)) == len(rollout), "pool.rollout_devices",
           f"distinct pool device indices in [0, pool.slots = {p.slots}), or [] (every stage on any free device)",
           rollout)
    _check(not rollout or p.slots - len(rollout) >= p.devices_per_step, "pool.rollout_devices",
           f"at most pool.slots - pool.devices_per_step = {p.slots - p.devices_per_step} devices: the others run "
           "the caching pass and the update; raise pool.slots or name fewer", rollout)


def _validate_tracking(cfg: Config) -> None:
    for name in cfg.report_to:
        _check(name in TRACKERS, "report_to", f"a list of trackers: {tracker_install_hint()}", name)


def _validate_limits(cfg: Config) -> None:
    """Sizes beyond limits.* are refused with the figure, the key and the limit to raise."""
    lim, r = cfg.limits, cfg.rollout
    for key in ("steps", "rollouts_per_prompt", "rollouts_per_step", "turns"):
        _check(getattr(lim, key) >= 1, f"limits.{key}", "an integer >= 1", getattr(lim, key))
    raise_it = "; raise {} if the run truly needs more"
    _check(cfg.steps <= lim.steps, "steps", f"at most limits.steps = {lim.steps}" + raise_it.format("limits.steps"),
           cfg.steps)
    per_prompt = math.prod(r.branching)
    _check(per_prompt <= lim.rollouts_per_prompt, "rollout.branching", f"{per_prompt} rollouts per prompt (the "
           f"product of the fan-outs), more than limits.rollouts_per_prompt = {lim.rollouts_per_prompt}"
           + raise_it.format("limits.rollouts_per_prompt"), r.branching)
    draws = cfg.algo.dynamic_sampling_draws if cfg.algo.dynamic_sampling else 1
    per_step = cfg.data.prompts_per_step * per_prompt * draws
    _check(per_step <= lim.rollouts_per_step, "data.prompts_per_step", f"{per_step} rollouts a step (data."
           f"prompts_per_step x {per_prompt} rollouts per prompt{f' x {draws} draws' if draws > 1 else ''}), more "
           f"than limits.rollouts_per_step = {lim.rollouts_per_step}" + raise_it.format("limits.rollouts_per_step"),
           cfg.data.prompts_per_step)
    _check(r.max_turns <= lim.turns, "rollout.max_turns", f"at most limits.turns = {lim.turns} turns an episode"
           + raise_it.format("limits.turns"), r.max_turns)


def _validate_sandbox(sb: SandboxConfig) -> None:
    for key in ("cpu_seconds", "checker_seconds"):
        _check(0 < getattr(sb, key) < math.inf, f"sandbox.{key}", "a finite number of seconds > 0", getattr(sb, key))
    _check(sb.memory_mb >= 256, "sandbox.memory_mb", "at least 256 (MiB of address space for the child process, "
           "whose Python and imports need some)", sb.memory_mb)


def _validate_storage(s: StorageConfig) -> None:
    _check(s.bandwidth_gbps > 0, "storage.bandwidth_gbps", "a number > 0", s.bandwidth_gbps)
    uri = s.uri
    _check(uri == "" or uri.startswith(("s3://", "file://", "/")) or "://" not in uri, "storage.uri",
           "empty (the run directory), a local path, file://... or s3://bucket/prefix", uri)
