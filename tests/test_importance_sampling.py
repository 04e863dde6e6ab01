"""Truncated importance sampling (algo.tis_cap): a token's advantage is weighted by
min(p_trainer / p_engine, cap), for rollout engines whose probabilities differ from the
trainer's."""

import math

import pytest
import torch

from lsreplay.core.config import ConfigError, load_config
from lsreplay.stages.objectives import importance_weights, tis_figures

TRAINER = [torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)]
ENGINE = [[-1.1, -3.0], [-0.2]]  # ratios e^0.1, e^1 (capped at 2), e^-0.3


def test_each_token_is_weighted_by_its_capped_ratio():
    weights = importance_weights(TRAINER, ENGINE, cap=2.0)
    assert torch.allclose(weights[0], torch.tensor([math.exp(0.1), 2.0], dtype=torch.float64))
    assert torch.allclose(weights[1], torch.tensor([math.exp(-0.3)], dtype=torch.float64))


def test_the_figures_say_how_many_tokens_the_cap_cut_and_the_mean_weight():
    weights = [importance_weights(TRAINER, ENGINE, cap=2.0)]
    figures = tis_figures(weights, 2.0, None)
    assert figures["tis_capped_fraction"] == pytest.approx(1 / 3)
    assert figures["tis_weight_mean"] == pytest.approx((math.exp(0.1) + 2.0 + math.exp(-0.3)) / 3)
    masked = tis_figures(weights, 2.0, [[False, True]])  # the capped token's completion is out of the loss
    assert masked == {"tis_capped_fraction": 0.0, "tis_weight_mean": pytest.approx(math.exp(-0.3))}


def test_a_cap_below_one_is_refused():
    with pytest.raises(ConfigError, match="algo.tis_cap"):
        load_config(None, ["algo.tis_cap=0.5"])
