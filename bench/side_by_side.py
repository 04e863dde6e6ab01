"""Measuring two computations side by side in one run: wall time in alternating order after
a warm-up at the same shape, device peak memory, and how far apart their gradients are."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

GiB = 2**30


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_measured(device: torch.device, fn: Callable[[], object]) -> int | None:
    """The allocator's peak while `fn` runs (CUDA; None on the CPU, which has no such counter)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device)


def alternating(runs: dict[str, Callable[[], object]], rounds: int, device: torch.device,
                warm_up: bool = True) -> dict[str, list[float]]:
    """Seconds of each run in each of `rounds`, the order reversed every round (so neither
    always runs first, into a cooler or warmer device), after a warm-up round at the same
    shape whose times are dropped (kernel choice, allocator growth, lazy init); without
    `warm_up` (runs of minutes, after others warmed the process up) none."""
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    first = 0 if warm_up else 1
    for round_ in range(first, rounds + 1):
        for name in names if round_ % 2 == 0 else names[::-1]:
            sync(device)
            start = time.perf_counter()
            runs[name]()
            sync(device)
            if round_ > 0:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def gradient_agreement(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    """How far `grads` are from `reference` (same tensors, same order):
    rel: max |g - r| over all tensors / max |r| over all tensors;
    worst_tensor: the largest per-tensor max |g - r| / max |r|;
    cosine: of the two, flattened (float64)."""
    diff = max(float((g.float() - r.float()).abs().max()) for g, r in zip(grads, reference))
    scale = max(float(r.abs().max()) for r in reference)
    per_tensor = [float((g.float() - r.float()).abs().max()) / max(float(r.abs().max()), 1e-30)
                  for g, r in zip(grads, reference)]
    dot = sum(float((g.double() * r.double()).sum()) for g, r in zip(grads, reference))
    norms = [sum(float(t.double().square().sum()) for t in ts) ** 0.5 for ts in (grads, reference)]
    return {"rel": diff / max(scale, 1e-30), "worst_tensor": max(per_tensor),
            "cosine": dot / max(norms[0] * norms[1], 1e-300)}


def key_values(fields: dict, digits: int = 4) -> str:
    """A bench's last line: key=value pairs, floats to `digits` significant digits."""
    return " ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
