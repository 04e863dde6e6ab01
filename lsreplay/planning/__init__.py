"""The memory planner's model: will one RL step of a config fit the devices, and how many
token positions does it train? `lsreplay plan` (lsreplay/commands/plan.py) prints it; the
preflight checks a run's replay budget with it.

Per device it counts, for branch replay and for the per-rollout (naive) backward:

- model state: compute weights, the gradient accumulator, AdamW moments and (bfloat16
  models: mixed precision) float32 master weights. With LoRA (model.lora) the base's
  weights in the compute dtype, and gradients, masters and moments for the adapters alone. Without FSDP every rank holds all of
  it. With FSDP (`lsreplay.distributed.parallel.shard_model`) the master weights, moments and reduced
  gradient are sharded over the ranks, but during the backward a rank holds the full
  compute weights and a full gradient accumulator (float32 for mixed precision): the
  backward gathers the parameters once and reduce-scatters once, because ranks run
  different trees (see lsreplay/distributed/parallel.py).
- held prefix K/V: the keys/values of the root-to-leaf path being replayed, and their
  gradients, the kept graphs above it, the layer inputs of a prompt run layer by layer
  (replay only).
- saved activations of the largest single forward/backward of the step: naive, one full
  rollout (prompt + completion); replay, the largest of: the recompute of a branching
  node, one layer's recompute over a chunk of a prompt run layer by layer, a micro-batch of
  sibling leaves on top of their prefix. This mirrors
  `replay_backward`'s schedule (including its leaf micro-batching) and counts what
  `ActivationMeter` counts, with per-tensor byte counts measured for Llama/Qwen2 under
  transformers 5.x, sdpa and cascade attention (`saved_bytes`; tests/test_plan.py checks it
  against the meter).
- workspace (estimate, not validated on a GPU): the transient logits of the run's
  completion tokens and twice one layer's activations for the backward; plus a fixed
  reserve (CUDA context, NCCL buffers) and 5% of the device for allocator fragmentation.

And for the rollouts, per device (one rollout shard holds one device): what the rollout
engine allocates at its peak (ROLLOUT_ENGINES, a function per engine; the HF tree sampler:
each prompt's K/V once and each decoding row's completion K/V, drafter features, sampling
buffers; vLLM: its KV cache, whose prefix cache holds each prompt once) next to what the other
stages leave resident there (the policy's compute weights, a one-device update's state,
the reference, the drafter).

And per host (pool.devices_per_host of the pool's devices; a verdict at pool.host_memory_gb):
the layer inputs its devices' backwards keep in pinned host memory (replay.offload_prefix),
the checkpoint snapshots, host-held prefix K/V, vLLM's update buffers.

Token positions per step are counted two ways: per-rollout (what a pipeline without
replay computes and what replay stands in for: prompts x G x (P + completion)) and
unique (what replay computes). Prompts are taken at data.max_prompt_tokens and completions
at their longest: rollout.max_new_tokens, or for multi-turn episodes rollout.max_turns replies
of max_new_tokens with rollout.max_environment_tokens of the environment's answer between
every two (lsreplay.core.config.completion_tokens, the bound the episodes keep): the worst
case for memory.

One concern a file:

- shape.py    TreeShape: a rollout tree as the config shapes it
- update.py   the update's peak run, replay's and the per-rollout backward's (RunPeak): the
              replay view's kept spans, a prompt's split over context-parallel ranks, the
              workspace beside the peak run
- context.py  a prompt split over ranks (replay.context_parallel): its memory, traffic, compute
- state.py    the model state: weights, gradients, masters, AdamW moments (critic, LoRA)
- rollout.py  the rollout engines' memory (ROLLOUT_ENGINES)
- step_io.py  what a step moves through the store
- host.py     what a host holds
- plan.py     Plan: all of it for one config (make_plan)
- units.py    GiB, the element bytes of each model.dtype
"""
