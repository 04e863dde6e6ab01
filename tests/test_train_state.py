"""The policy's trainable state on the host: torch's fused AdamW, gradients kept and zeroed in
place between steps, the one-pass finiteness check, and optimizer checkpoints that keep the
live optimizer's implementation."""

from __future__ import annotations

import math

import torch
from conftest import tiny_model

from lsreplay.core.config import OptimConfig
from lsreplay.core.storage import Store
from lsreplay.models.train_state import TrainState
from lsreplay.state.checkpoint import load_optimizer, save_optimizer

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01)


def backward(model, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()


def test_the_host_state_steps_with_fused_adamw_as_the_per_tensor_loop_does():
    state, reference = TrainState(tiny_model(), OPTIM), tiny_model()
    loop = torch.optim.AdamW(reference.parameters(), lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2),
                             weight_decay=OPTIM.weight_decay, foreach=False)
    assert state.optimizer.param_groups[0]["fused"] is True
    for seed in range(3):
        for model in (state.model, reference):
            backward(model, seed)
        state.step()
        loop.step()
        state.zero_grad()
        reference.zero_grad(set_to_none=True)
    for mine, theirs in zip(state.model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_gradients_stay_zeroed_in_place_and_a_step_that_trains_nothing_moves_the_moments():
    state = TrainState(tiny_model(), OPTIM)
    backward(state.model, 0)
    state.step()
    kept = [m.grad.data_ptr() for m in state.masters]
    state.zero_grad()
    assert [m.grad.data_ptr() for m in state.masters] == kept
    assert all(m.grad.abs().max() == 0 for m in state.masters)
    before = [state.optimizer.state[m]["exp_avg"].clone() for m in state.masters]
    state.step()  # nothing trained: a zero gradient decays the first moments
    for m, first in zip(state.masters, before):
        torch.testing.assert_close(state.optimizer.state[m]["exp_avg"], first * OPTIM.beta1)


def test_nonfinite_names_the_parameters_that_hold_nan_or_inf():
    state = TrainState(tiny_model(), OPTIM)
    assert state.nonfinite() == []
    names = dict(zip(state.names, state.masters))
    with torch.no_grad():
        names["model.layers.0.mlp.up_proj.weight"][1, 2] = math.nan
        names["lm_head.weight"][0, 0] = -math.inf
    assert state.nonfinite() == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]


def test_an_optimizer_checkpoint_loads_its_moments_but_keeps_the_live_implementation(tmp_path):
    saved = TrainState(tiny_model(), OPTIM)
    backward(saved.model, 0)
    saved.step()
    store = Store(str(tmp_path))
    save_optimizer(store, "opt", saved.optimizer)
    loop = torch.optim.AdamW(tiny_model().parameters(), foreach=False)  # as a run on another device might build it
    load_optimizer(store, "opt", loop)
    assert loop.param_groups[0]["fused"] is None and loop.param_groups[0]["foreach"] is False
    fresh = TrainState(tiny_model(), OPTIM)
    save_optimizer(store, "loop", loop)
    load_optimizer(store, "loop", fresh.optimizer)
    assert fresh.optimizer.param_groups[0]["fused"] is True
    for m, n in zip(fresh.masters, saved.masters):
        assert torch.equal(fresh.optimizer.state[m]["exp_avg_sq"], saved.optimizer.state[n]["exp_avg_sq"])
