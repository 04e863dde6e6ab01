"""Policy versions held for asynchronous rollouts (lsreplay.state.resident): the policy an
update publishes stays as it was while later updates change the trainer's copy in place,
the versions no rollout may still ask for are let go, a vLLM engine serves one version at a
time, enough checkpoints stay for a resume to load the versions it samples with, and the
drafter the rollouts speculate with follows their version."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from lsreplay.stages.trees import rollout_drafter
from lsreplay.stages.versions import off_policy_figures
from lsreplay.state import checkpointing
from lsreplay.state.resident import Resident

CPU = torch.device("cpu")


def test_a_published_version_stays_as_the_update_made_it(tiny_model_dir, tmp_path):
    run = Run(load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "rollout.max_staleness=1"]))
    resident = Resident()
    base = resident.sampler(run, 0, CPU)  # no update yet: the base model, frozen
    trainer = resident.policy(run, 0, CPU)
    assert base is not trainer and not any(p.requires_grad for p in base.parameters())
    base = {n: p.clone() for n, p in base.named_parameters()}  # its memory serves a later version once let go
    versions = []
    for step in range(3):
        with torch.no_grad():  # an update, in place
            for p in trainer.parameters():
                p.add_(0.01 * (step + 1))
        resident.updated(run, step, CPU)
        versions.append({n: p.clone() for n, p in resident.sampler(run, step + 1, CPU).named_parameters()})
    for step, weights in enumerate(versions):  # each as its update left it, later updates notwithstanding
        shift = 0.01 * sum(range(1, step + 2))
        for name, p in base.items():
            assert torch.allclose(weights[name], p + shift, atol=1e-6), (step, name)
    # Versions 1 and 2 are published; 1 is older than 3 - max_staleness and was let go.
    assert sorted(v for _, v in resident._versions) == [2, 3]
    resident.release(run)
    assert not resident._versions


def test_an_engine_serves_one_policy_version_at_a_time():
    resident, order = Resident(), []

    def shard(version: int, hold: float, name: str):
        with resident.serving(CPU, version):
            order.append(f"{name} in")
            time.sleep(hold)
            order.append(f"{name} out")

    first = threading.Thread(target=shard, args=(3, 0.4, "a"))
    first.start()
    time.sleep(0.1)
    same = threading.Thread(target=shard, args=(3, 0.1, "b"))  # the same version shares the engine
    other = threading.Thread(target=shard, args=(4, 0.0, "c"))  # another waits until both ended
    same.start()
    time.sleep(0.05)
    other.start()
    for t in (first, same, other):
        t.join()
    assert order.index("b in") < order.index("a out")
    assert order.index("c in") > max(order.index("a out"), order.index("b out"))


def test_enough_checkpoints_stay_for_the_versions_a_resume_samples_with(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "checkpoint.keep_last=1", "rollout.max_staleness=2"])
    run = Run(cfg)
    for step in range(5):  # committed checkpoints: checkpoint.json and the policy stage's marker
        run.store.write_json(f"{run.checkpoint('policy', step)}/{checkpointing.COMPLETE}", {"files": {}})
        run.finish(step, "policy", {"files": []})
    assert checkpointing.prune(run) == [0, 1]
    assert checkpointing.committed_steps(run) == [2, 3, 4]  # versions 3, 4, 5: those of steps 5, 6 and 7


def test_the_rollouts_speculate_with_the_drafter_of_their_policy_version(tmp_path):
    """The drafter of step t shares its embedding and head with version t + 1 and trains
    alongside the first rollouts of that version: rollouts sampled by version v take the
    newest trained one up to step v - 2's, whichever step they are for."""
    for k, expected in ((0, [None, None, 0, 0, 2, 2]), (1, [None, None, None, 0, 0, 2]),
                        (2, [None, None, None, None, 0, 0])):
        run = Run(load_config(None, [f"run_dir={tmp_path / str(k)}", f"rollout.max_staleness={k}"]))
        for step, trained in enumerate([True, False, True, False]):  # step 1's session trained nothing
            checkpoint = run.checkpoint("drafter", step) if trained else None
            run.finish(step, "drafter", {"files": [], "checkpoint": checkpoint})
        assert [rollout_drafter(run, step) for step in range(6)] == expected, k


def test_the_behaviour_ratios_figures_per_staleness():
    """w = e^0.1, e^1, e^-0.3 on one completion of a tree one update stale, e^-2 on a tree
    two updates stale, cap 2: TIS caps e^1 (2 > e^0.69), MIS masks e^1 and e^-2 (outside
    [1/2, 2]); a tree left out of the loss and a masked completion count nowhere."""
    records = [{"staleness": 1}, {"staleness": 2}, {"staleness": 1}]
    proximal = [[torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])], [torch.tensor([-1.0])],
                [torch.tensor([5.0])]]
    behaviour = [[torch.tensor([-1.1, -3.0, -0.2]), torch.tensor([9.0])], [torch.tensor([1.0])], [torch.tensor([0.0])]]
    keep, mask = [True, True, False], [[True, False], [True], [True]]
    figures = off_policy_figures(records, proximal, behaviour, 2.0, keep, mask)
    assert sorted(figures) == sorted(f"off_policy/staleness{k}/{name}" for k in (1, 2) for name in
                                     ("logprob_gap", "tis_weight_mean", "tis_capped_fraction", "mis_masked_fraction",
                                      "mis_seq_masked_fraction"))
    one = {k.split("/")[-1]: v for k, v in figures.items() if "staleness1" in k}
    assert one["logprob_gap"] == pytest.approx((0.1 + 1.0 + 0.3) / 3)
    assert one["tis_weight_mean"] == pytest.approx((math.exp(0.1) + 2 + math.exp(-0.3)) / 3)
    assert one["tis_capped_fraction"] == pytest.approx(1 / 3) and one["mis_masked_fraction"] == pytest.approx(1 / 3)
    assert one["mis_seq_masked_fraction"] == 1
    two = {k.split("/")[-1]: v for k, v in figures.items() if "staleness2" in k}
    assert two["mis_masked_fraction"] == 1 and two["tis_capped_fraction"] == 0
