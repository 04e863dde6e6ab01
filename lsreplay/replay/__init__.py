"""Branch replay: prefix K/V capture, the replay backward, and the per-rollout reference."""

from lsreplay.replay.backward import BackwardStats, PrefixKVSource, naive_backward, replay_backward
from lsreplay.replay.memory import ActivationMeter

__all__ = ["ActivationMeter", "BackwardStats", "PrefixKVSource", "naive_backward", "replay_backward"]
