"""The policy's trainable state: float32 master weights, gradients and AdamW moments, with
the model computing in its own dtype.

Mixed precision as production trainers do it. With `model.dtype=bfloat16` the model's
parameters are bf16 copies that every forward and backward computes with; the optimizer
owns float32 masters of them. An AdamW update of 1e-6 relative is below half a bf16 ulp,
so updates applied to bf16 weights mostly vanish; applied to the masters they add up,
and the compute copies are refreshed from the masters after every step.

Replay calls backward many times per step (one per run). Each call's bf16 gradient is
added into the master's float32 `.grad` by a post-accumulate hook and the bf16 one
dropped, so gradients accumulate in float32, never in bf16. A parameter has one such hook
whatever the number of states built over it (a resident copy's model is reused, a state
moves to another device and back): its gradient goes to the masters of the newest state,
and the hook holds them weakly, so a superseded state's masters and gradients go with it.

With a float32 or float64 model the masters are the model's own parameters: no copies,
no hooks, exactly the plain training of before.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lsreplay.algos.critic import is_critic
from lsreplay.core.config import OptimConfig
from lsreplay.models.logits import FULL_PRECISION


def master_dtype(compute: str) -> str:
    """The masters' dtype for a model computing in `compute`: float32 under bfloat16."""
    return compute if getattr(torch, compute) in FULL_PRECISION else "float32"


def lr_factor(optim: OptimConfig, update: int, total: int) -> float:
    """The learning rate of optimizer update `update` (0-based) of `total`, over the
    configured one (optim.schedule, optim.warmup_steps): a pure function of the update's
    index, so a resumed run continues the schedule exactly where the checkpoint left it."""
    warmup = optim.warmup_steps
    if update < warmup:
        return (update + 1) / warmup
    if optim.schedule == "constant":
        return 1.0
    done = min((update - warmup) / max(total - warmup, 1), 1.0)
    return 1.0 - done if optim.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))


class TrainState:
    """`model` (computing in its dtype) plus master parameters, their gradients, AdamW.
    value_lr: the learning rate of a critic's value head on the model (lsreplay.algos.critic),
    in an AdamW parameter group of its own; None = every parameter at optim.lr."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, value_lr: float | None = None):
        self.model = model
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in trainable], [p for _, p in trainable]
        self.mixed = self.params[0].dtype not in FULL_PRECISION
        if self.mixed:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            for param, master in zip(self.params, self.masters):
                _route_to_master(param, master)
        else:
            self.masters = self.params
        groups = [{"params": self.masters, "lr": optim.lr}]
        if value_lr is not None:
            critic = [is_critic(n) for n in self.names]
            groups = [{"params": [m for m, c in zip(self.masters, critic) if not c], "lr": optim.lr},
                      {"params": [m for m, c in zip(self.masters, critic) if c], "lr": value_lr}]
        self.base_lrs = [g["lr"] for g in groups]
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay, fused=_on_host(self.masters) or None)
        self.optim, self.value_lr = optim, value_lr

    def schedule(self, update: int, total: int) -> None:
        """Set every parameter group's learning rate for optimizer update `update` of `total`."""
        factor = lr_factor(self.optim, update, total)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def zero_grad(self) -> None:
        """No gradient yet. On the host the gradient tensors stay and are zeroed in place:
        a fresh weight-sized tensor faults its pages in again at every step (1.9 s of a
        step that trained nothing for SmolLM2-135M on the 2-core machine: the
        zeros_like of `step`). On an accelerator they go, and their memory with them, to
        the rollouts until the next backward (the allocator hands the blocks back cheaply)."""
        host = _on_host(self.masters)
        for master in self.masters:
            if host and master.grad is not None:
                master.grad.zero_()
            else:
                master.grad = None

    def clip_grad_norm(self) -> float:
        """Clip the master gradients to optim.grad_clip (0: no clipping); their norm before."""
        if self.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.masters, self.optim.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([m.grad for m in self.masters if m.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def step(self) -> None:
        """AdamW on the masters, then the compute weights follow them. A master the backward
        did not reach (its loss weights all zero: replay skips them) has a zero gradient, so a
        step that trains nothing moves the moments as AdamW does, not a step that skips it."""
        for master in self.masters:
            if master.grad is None:
                master.grad = torch.zeros_like(master)
        self.optimizer.step()
        self.follow_masters()

    def follow_masters(self) -> None:
        """Refresh the compute weights from the masters (after they changed)."""
        if self.mixed:
            with torch.no_grad():
                for param, master in zip(self.params, self.masters):
                    param.copy_(master)

    def shared(self) -> dict:
        """The masters and AdamW moments in shared memory, for the data-parallel ranks of a
        policy update to read and write in place (lsreplay.stages.policy): {"masters":
        {name: tensor}, "optimizer": [per master {"step", "exp_avg", "exp_avg_sq"}]}.
        Moments not created yet are created as AdamW's first step would (zeros, step 0)."""
        for master in self.masters:
            state = self.optimizer.state[master]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
        moments = [self.optimizer.state[m] for m in self.masters]
        for t in [*self.masters, *(v for s in moments for v in s.values())]:
            t.share_memory_()
        return {"masters": dict(zip(self.names, (m.detach() for m in self.masters))), "optimizer": moments}

    def nonfinite(self) -> list[str]:
        """Names of master parameters holding NaN or inf. One pass over them first (a NaN or
        inf anywhere makes the sum of the norms one): the tensor-by-tensor check, which
        allocates a mask per tensor, only when it finds one."""
        if local(self.masters[0]).device.type == "cpu":
            norms = torch._foreach_norm([local(m) for m in self.masters])
            if torch.isfinite(torch.stack(norms).sum()):
                return []
        return [n for n, m in zip(self.names, self.masters)
                if not torch.isfinite(local(m)).all()]

    def moved_to(self, model: torch.nn.Module) -> TrainState:
        """This state for `model` (the same weights on another device): masters and AdamW
        moments move there."""
        moved = TrainState(model, self.optim, self.value_lr)
        with torch.no_grad():
            for master, old in zip(moved.masters, self.masters):
                master.copy_(old)
        state = self.optimizer.state_dict()
        keep_implementation(state["param_groups"], moved.optimizer.param_groups)
        moved.optimizer.load_state_dict(state)  # moves the moments to the masters' device
        return moved

    # -- checkpoints: masters by the model's parameter names -------------------------------
    def master_tensors(self) -> dict[str, torch.Tensor]:
        """The masters by parameter name, and the model's persistent buffers: a full model file."""
        state = self.model.state_dict()
        buffers = {n: state[n] for n, _ in self.model.named_buffers() if n in state}
        return {**{n: m.detach() for n, m in zip(self.names, self.masters)}, **buffers}

    def load_masters(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set masters (and so the compute weights) from `tensors` by name."""
        with torch.no_grad():
            for name, master in zip(self.names, self.masters):
                master.copy_(tensors[name])
        self.follow_masters()


# How an optimizer computes, not what it holds: a loaded state keeps the live optimizer's
# (a state saved on the host, fused, may be loaded on an accelerator or into FSDP shards).
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def keep_implementation(groups: list[dict], live_groups: list[dict]) -> None:
    """Set the IMPLEMENTATION flags of the parameter groups `groups` (of a state to load) to
    the live optimizer's."""
    for group, live in zip(groups, live_groups):
        group.update({name: live[name] for name in IMPLEMENTATION if name in live})


def _on_host(masters: list[torch.Tensor]) -> bool:
    """Plain tensors in host memory (not an accelerator's, not FSDP's DTensor shards): where
    torch's fused AdamW runs on the CPU (4x its default per-tensor loop for SmolLM2-135M in
    float32, 9x in float64, on 2 cores) and where gradients are kept between steps."""
    return all(type(m.data) is torch.Tensor and m.device.type == "cpu" for m in masters)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP (DTensor) tensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


# A compute parameter -> (a weak reference to) the master its gradients go into.
_MASTERS = WeakIdKeyDictionary()


def _route_to_master(param: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
    """From now on `param`'s gradients go into `master`: hooked once, rerouted after."""
    if param not in _MASTERS:
        param.register_post_accumulate_grad_hook(_into_master)
    _MASTERS[param] = weakref.ref(master)


def _into_master(param: torch.Tensor) -> None:
    master = _MASTERS[param]()
    if master is None:  # its state is gone: the gradient stays where autograd put it
        return
    grad = param.grad.to(master.dtype)
    master.grad = grad if master.grad is None else master.grad.add_(grad)
    param.grad = None

