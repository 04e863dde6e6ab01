"""The names TRL's GRPOConfig (with the TrainingArguments it extends and TRL's script
arguments) and verl's trainer config give what lsreplay calls otherwise: an unknown config
key found here is answered with lsreplay's key (the first word of the entry, before any
`=`) and how the two relate.

A key is looked up by its whole dotted name, then by ever shorter tails of it
(`actor_rollout_ref.rollout.n`, `rollout.n`, `n`), then so for the section it is in, so
verl's nested keys find their entry under whatever section a user nests them. Names with no lsreplay equivalent are left out:
the nearest lsreplay keys answer those.
"""

from __future__ import annotations

_PROMPTS_PER_STEP = ("data.prompts_per_step (prompts per step, each with G rollouts; TRL's per_device_train_batch_size "
                     "counts completions: prompts_per_step = per_device_train_batch_size x "
                     "gradient_accumulation_steps x processes / num_generations)")

TRL = {
    "num_generations": "rollout.branching (G rollouts per prompt are the product of its fan-outs: [8], or [4, 2])",
    "num_generations_eval": "eval.samples (sampled answers per held-out prompt, next to one greedy answer)",
    "max_completion_length": "rollout.max_new_tokens", "max_prompt_length": "data.max_prompt_tokens",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "beta": "algo.kl_coef", "epsilon": "algo.clip_eps",
    "epsilon_high": "algo.clip_eps_high (the ratio's upper clip is 1 + clip_eps_high, as TRL's 1 + epsilon_high)",
    "loss_type": "algo.loss_agg (TRL's dapo and bnpo: token-mean; grpo: seq-mean; dr_grpo: seq-mean-token-sum-norm)",
    "scale_rewards": "algo.scale_rewards (group, batch or none, as TRL takes them)",
    "mask_truncated_completions": "algo.overlong=mask (answers cut at rollout.max_new_tokens are left out of the loss)",
    "num_iterations": "algo.epochs (with algo.name=ppo: that many passes of the clipped surrogate over each batch, "
                      "with GRPO's group advantages: algo.advantage=group)",
    "steps_per_generation": "algo.minibatches (with algo.name=ppo: that many updates per batch of rollouts)",
    "generation_batch_size": "data.prompts_per_step (prompts per step; TRL counts the batch in completions: "
                             "prompts x num_generations)",
    "use_vllm": "rollout.engine=vllm (a vLLM engine per pool device, following the policy in memory)",
    "vllm_mode": "rollout.engine=vllm (lsreplay starts one engine per pool device itself: TRL's colocate)",
    "vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "vllm_importance_sampling_correction": "algo.tis_cap (truncated importance sampling per token against the "
                                           "engine's logprobs, TRL's token_truncate mode; e.g. algo.tis_cap=3)",
    "vllm_importance_sampling_cap": "algo.tis_cap", "vllm_importance_sampling_clip_max": "algo.tis_cap",
    "reward_funcs": "reward.functions", "reward_weights": "reward.weights",
    # TrainingArguments
    "learning_rate": "optim.lr", "weight_decay": "optim.weight_decay", "adam_beta1": "optim.beta1",
    "adam_beta2": "optim.beta2", "max_grad_norm": "optim.grad_clip",
    "lr_scheduler_type": "optim.schedule (constant, linear or cosine; TRL's default is linear, lsreplay's constant)",
    "warmup_steps": "optim.warmup_steps", "warmup_ratio": "optim.warmup_steps (in optimizer updates: ratio x steps)",
    "max_steps": "steps", "num_train_epochs": "steps (RL steps; an epoch is the training rows / "
                                               "data.prompts_per_step steps)",
    "per_device_train_batch_size": _PROMPTS_PER_STEP, "gradient_accumulation_steps": _PROMPTS_PER_STEP,
    "output_dir": "run_dir", "save_steps": "checkpoint.every (steps between policy checkpoints)",
    "save_total_limit": "checkpoint.keep_last", "eval_steps": "eval.every (steps between held-out evaluations)",
    "bf16": "model.dtype=bfloat16 (bf16 compute over float32 master weights, as bf16 mixed precision)",
    "fp16": "model.dtype (float32, bfloat16 or float64: there is no float16)",
    "logging_dir": "tracking.dir", "run_name": "tracking.run_name", "project": "tracking.project",
    "resume_from_checkpoint": "run_dir (running again on the same run_dir resumes it; `lsreplay resume RUN_DIR`)",
    # TRL's script arguments (trl/scripts/grpo.py) and ModelConfig
    "dataset_name": "data.path (a local file or a folder datasets' save_to_disk wrote: nothing is downloaded)",
    "dataset_train_split": "data.split", "dataset_test_split": "eval.split",
    "model_name_or_path": "model.path", "dtype": "model.dtype", "torch_dtype": "model.dtype",
    # TRL's ModelConfig LoRA flags, and the LoraConfig TRL takes as peft_config
    "use_peft": "model.lora.enabled (LoRA adapters through PEFT)", "peft_config": "model.lora.enabled (and model.lora.rank, "
                "alpha, target_modules: PEFT's LoraConfig r, lora_alpha, target_modules)",
    "lora_r": "model.lora.rank", "peft_config.r": "model.lora.rank", "lora.r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout (0 only: replay trains without dropout)",
    "lora_target_modules": "model.lora.target_modules", "target_modules": "model.lora.target_modules",
}

VERL = {
    "train_files": "data.path", "val_files": "eval.path", "train_batch_size": "data.prompts_per_step",
    "max_response_length": "rollout.max_new_tokens", "prompt_key": "data.columns.prompt",
    "truncation": "data.prompt_truncation (error, left, right or middle: where an overlong prompt's own text is cut, "
                  "never its chat template)",
    "apply_chat_template_kwargs": "data.chat_template_kwargs",
    "rollout.n": "rollout.branching (G rollouts per prompt are the product of its fan-outs: [8], or [4, 2])",
    "rollout.name": "rollout.engine (hf or vllm)",
    "rollout.gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "model.path": "model.path", "lora_rank": "model.lora.rank (with model.lora.enabled=true)",
    "optim.lr_warmup_steps": "optim.warmup_steps", "optim.clip_grad": "optim.grad_clip",
    "optim.warmup_style": "optim.schedule", "optim.betas": "optim.beta1 (and optim.beta2)",
    "grad_clip": "optim.grad_clip", "lr": "optim.lr",
    "clip_ratio": "algo.clip_eps", "clip_ratio_low": "algo.clip_eps",
    "clip_ratio_high": "algo.clip_eps_high (the ratio's upper clip is 1 + clip_eps_high)",
    "loss_agg_mode": "algo.loss_agg (verl's token-mean, seq-mean-token-mean: seq-mean, seq-mean-token-sum-norm)",
    "use_kl_loss": "algo.kl_coef (> 0: a KL loss to the frozen base model, verl's kl_loss_coef)",
    "kl_loss_coef": "algo.kl_coef", "kl_coef": "algo.kl_coef (a KL term in the loss; lsreplay puts none in the reward)",
    "kl_loss_type": "algo.kl_estimator (verl's kl: k1, mse: k2, low_var_kl: k3)",
    "ppo_epochs": "algo.epochs (with algo.name=ppo)",
    "ppo_mini_batch_size": "algo.minibatches (with algo.name=ppo: data.prompts_per_step / ppo_mini_batch_size)",
    "ppo_micro_batch_size_per_gpu": "replay.budget_mb (the memory of one micro-batch, MiB)",
    "adv_estimator": "algo.name (grpo: algo.name=grpo; gae: algo.name=ppo algo.critic=true algo.advantage=gae)",
    "norm_adv_by_std_in_grpo": "algo.scale_rewards (true: group, false: none)",
    "gamma": "algo.gamma", "lam": "algo.lam",
    "rollout_is_threshold": "algo.tis_cap (truncated importance sampling per token against the engine's logprobs)",
    "filter_groups.enable": "algo.dynamic_sampling", "filter_groups.max_num_gen_batches": "algo.dynamic_sampling_draws",
    "overlong_buffer.enable": "algo.overlong=penalty", "overlong_buffer.len": "algo.overlong_buffer",
    "overlong_buffer.penalty_factor": "algo.overlong_penalty",
    "custom_reward_function.path": "reward.functions (path/to/file.py:function)",
    "custom_reward_function.name": "reward.functions (path/to/file.py:function)",
    "custom_reward_function": "reward.functions (path/to/file.py:function)",
    "reward_kwargs": "reward.kwargs (one dict per function in reward.functions)",
    "reward_model.model.path": "reward.functions (a reward model's folder is a reward function of its own)",
    "reward_model.enable": "reward.functions (a reward model's folder is a reward function of its own)",
    "total_training_steps": "steps", "total_epochs": "steps (RL steps; an epoch is the training rows / "
                                                     "data.prompts_per_step steps)",
    "project_name": "tracking.project", "experiment_name": "tracking.run_name", "logger": "report_to",
    "default_local_dir": "run_dir", "save_freq": "checkpoint.every", "test_freq": "eval.every",
    "max_actor_ckpt_to_keep": "checkpoint.keep_last", "n_gpus_per_node": "pool.slots",
    "val_before_train": "eval.every (with evaluation on, the base model is evaluated before step 0)",
}

ALIASES = {**VERL, **TRL}


def alias_of(key: str) -> tuple[str, str] | None:
    """(the name matched, its entry) for a dotted key: the longest tail of it that has one,
    else of the section above it (custom_reward_function.reward_kwargs.n: reward_kwargs)."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        for start in range(end):
            name = ".".join(parts[start:end])
            if name in ALIASES:
                return name, ALIASES[name]
    return None
