"""The schema: Config, a run's top-level keys and one section per concern, each key with its
comment (the sections live in model.py, data.py, rollout.py, training.py and runtime.py).
Dataclasses only: loading.py fills them, validation.py checks them."""

from __future__ import annotations

from dataclasses import dataclass, field

from lsreplay.core.config.data import DataConfig, EvalConfig, RewardConfig
from lsreplay.core.config.model import ModelConfig
from lsreplay.core.config.rollout import DrafterConfig, RolloutConfig
from lsreplay.core.config.runtime import (CheckpointConfig, LimitsConfig, PoolConfig, SandboxConfig, StorageConfig,
                                          TrackingConfig)
from lsreplay.core.config.training import AlgoConfig, OptimConfig, ReplayConfig


class ConfigError(ValueError):
    """A config key, type or value that cannot work; the message says which and why."""


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
