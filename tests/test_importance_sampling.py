"""Truncated importance sampling (algo.tis_cap): a token's advantage is weighted by
min(p_trainer / p_engine, cap), for rollout engines whose probabilities differ from the
trainer's."""

import math

import pytest
import torch

from lsreplay.core.config import ConfigError, load_config
from lsreplay.stages.objectives import importance_weighted


def test_each_token_is_weighted_by_its_capped_ratio():
    advantages = torch.tensor([1.5, -2.0], dtype=torch.float64)
    trainer = [torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)]
    engine = [[-1.1, -3.0], [-0.2]]  # ratios e^0.1, e^1 (capped at 2), e^-0.3
    weighted = importance_weighted(advantages, trainer, engine, cap=2.0)
    assert torch.allclose(weighted[0], torch.tensor([1.5 * math.exp(0.1), 1.5 * 2.0], dtype=torch.float64))
    assert torch.allclose(weighted[1], torch.tensor([-2.0 * math.exp(-0.3)], dtype=torch.float64))


def test_a_cap_below_one_is_refused():
    with pytest.raises(ConfigError, match="algo.tis_cap"):
        load_config(None, ["algo.tis_cap=0.5"])
