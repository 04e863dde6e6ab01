"""The sections of what a run reads: the prompts (data), how answers are scored (reward) and
the held-out evaluation (eval)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# What lsreplay adds to the prompts it generates (data.path empty): its reasoning-gym rewards
# read the <answer> tag. A dataset of yours gets nothing unless the config says so.
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
ANSWER_INSTRUCTION = (
    "\n\nWork it out briefly, then end your reply with the final answer inside "
    "<answer> and </answer> tags, with nothing else inside the tags."
)

# The roles of data.example_messages: earlier turns of the conversation (the system message comes first).
EXAMPLE_ROLES = ("user", "assistant", "tool")
PROMPT_TRUNCATIONS = ("error", "left", "right", "middle")


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


# How a reward function is called (reward.styles; lsreplay.data.rewards): told by its parameters, or named.
REWARD_STYLES = ("auto", "trl", "verl", "lsreplay")


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


def reward_specs(reward: RewardConfig) -> list[str]:
    """The import paths of the configured reward functions (reward.functions, or the older
    reward.function); empty = reasoning-gym's checkers."""
    return list(reward.functions) or ([reward.function] if reward.function else [])


def is_reward_model(spec: str) -> bool:
    """A reward function given as a model (TRL's reward_funcs given a str): a local folder, or
    an `org/name` model id (from the local HF cache only), rather than an import path (one
    with a slash names a file: path/to/file.py:function)."""
    return Path(spec).is_dir() or ("/" in spec and ":" not in spec)


def is_import_path(spec: str) -> bool:
    """module.function, module:function or path/to/file.py:function (a reward function's, a
    tool's or an environment's spec)."""
    module, colon, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    return bool(module and colon and name)
