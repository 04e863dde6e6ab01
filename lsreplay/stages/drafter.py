"""Stage 5: distil the EAGLE-style drafter on the hidden states the caching pass stored
(no extra target forward), starting from the previous step's drafter."""

from __future__ import annotations

import dataclasses
import time

import torch

from lsreplay import faults
from lsreplay.checkpoint import load_module, save_module
from lsreplay.drafter.distill import distill
from lsreplay.drafter.export import save_hf
from lsreplay.drafter.model import Drafter
from lsreplay.run import Run
from lsreplay.stages.common import load_trees, policy_before
from lsreplay.stages.prefixes import load_activations


def distill_drafter(run: Run, step: int) -> dict:
    if done := run.done(step, "drafter"):
        return done
    run.begin(step, "drafter")
    d = run.cfg.drafter
    prefixes = run.manifest(step, "prefixes")
    _, trees = load_trees(run, step)
    target = policy_before(run, step)
    # A fresh drafter's initial weights come from the global RNG: seed it per (run, step), so
    # a resumed process starts from the same weights as an uninterrupted one.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed(step, "drafter-init"))
        drafter = Drafter.from_target(target)
    if step > 0:
        with run.reading(step - 1, "drafter"):
            load_module(run.store, run.checkpoint("drafter", step - 1), drafter,
                        run.checkpoint_manifest("drafter", step - 1))
    sequences = [seq for i, tree in enumerate(trees)
                 for seq in load_activations(run, step, i, prefixes).path_sequences(tree)]
    start = time.perf_counter()
    stats = distill(drafter, sequences, steps=d.steps, lr=d.lr, batch_size=d.batch_size,
                    generator=run.generator(step, "drafter"))
    prefix = run.checkpoint("drafter", step)
    ckpt = save_module(run.store, prefix, drafter, {"step": step, "drafter": drafter.config_dict(),
                                                    "stats": dataclasses.asdict(stats)})
    exported = save_hf(run.store, f"{prefix}/hf", drafter)  # usable on its own: `lsreplay generate`
    faults.hook("drafter", step, "mid")
    return run.finish(step, "drafter", {
        "files": [*ckpt["files"].values(), *exported.values()], "checkpoint": prefix, "sequences": len(sequences),
        **{f"drafter_{k}": v for k, v in dataclasses.asdict(stats).items()},
        "seconds": time.perf_counter() - start})
