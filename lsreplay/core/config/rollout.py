"""The sections of how rollouts are sampled: the rollout trees and episodes (rollout), the vLLM
engine (rollout.vllm), and the drafter that speculates in their long tail (drafter); with what
they imply for an episode's length."""

from __future__ import annotations

from dataclasses import dataclass, field


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
