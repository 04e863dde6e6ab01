"""The sections of how a run runs: its checkpoints (checkpoint), where it writes (storage),
the accelerator pool its stages share (pool), the trackers it reports to (tracking), the
sizes it refuses (limits) and the sandbox of what others wrote (sandbox)."""

from __future__ import annotations

from dataclasses import dataclass, field

# What a pool slot's device index names (pool.accelerator).
ACCELERATORS = ("cpu", "cuda")


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
    # Seconds one try of a stage may run. Longer ends the flow's process (a stage blocked in C or
    # on a socket cannot be stopped otherwise), naming the stage and `lsreplay resume` (thread
    # runner: lsreplay.core.deadline); under Ray the stage's host is ended and the try retried.
    # 0 = no limit.
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


# The trackers report_to names, and the package each needs.
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "trackio": "trackio", "wandb": "wandb"}


def tracker_install_hint() -> str:
    return (", ".join(f"{name} (pip install {package})" for name, package in TRACKERS.items())
            + "; all of them: pip install 'lsreplay[trackers]'")


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
