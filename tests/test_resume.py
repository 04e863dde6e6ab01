"""Resume: a run SIGKILLed in the middle of any stage and resumed ends bit-identical to an
uninterrupted run, without redoing finished stages; damaged outputs are recomputed; a
config that changes results is refused on resume."""

from __future__ import annotations

import json
import shutil

import pytest

from flowrun import digests, lsreplay_chain, reference_run, step0_copy, tiny, unique_pool

from lsreplay import cli
from lsreplay.core.config import load_config
from lsreplay.core.layout import STAGES
from lsreplay.core.run import Run

STEP1 = ["step_0001", "checkpoints/policy/step_0001", "checkpoints/drafter/step_0001"]


def done(run_dir, step, stage):
    return (run_dir / f"step_{step:04d}" / f"{stage}.done.json").is_file()


def executions(run_dir) -> dict:
    return Run(load_config(None, [f"run_dir={run_dir}"])).executions()


def test_killed_in_each_stage_then_resumed_is_bit_identical(prefect_server, tiny_model_dir, tmp_path_factory,
                                                            tmp_path):
    """One chain: step 1 is killed (SIGKILL) in the middle of prompts, then, resumed, in the
    middle of trees, ..., then of drafter; the last resume finishes. Each stage of step 1
    runs exactly twice, and the weights equal the uninterrupted reference run's.

    The reference computed in this process, with the one torch thread the test session
    uses, and recorded it; every resuming process starts with two threads, as on a
    machine with more cores, and still computes with the recorded one."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    assert json.loads((ref.run_dir / "config.json").read_text())["config"]["threads"] == 1
    run_dir = step0_copy(ref, tmp_path / "run")  # step 0 as the reference left it, a one-step run
    jobs = [(["resume", str(run_dir), unique_pool(), *(["--steps", "2"] if i == 0 else [])], f"{stage}@1:kill")
            for i, stage in enumerate(STAGES)]
    for stage, result in zip(STAGES, lsreplay_chain(jobs, tmp_path, threads=2)):
        assert result["returncode"] == -9, f"not killed in {stage}:\n{result['log'][-3000:]}"
        assert f"injected kill in the middle of stage {stage} of step 1" in result["log"]
        assert "1 torch threads" in result["log"]
    assert [s for s in STAGES if done(run_dir, 1, s)] == list(STAGES[:-1])
    assert (run_dir / "checkpoints/drafter/step_0001/model.safetensors").is_file()  # outputs, no marker
    assert cli.main(["resume", str(run_dir), unique_pool()]) == 0

    assert digests(run_dir, *STEP1) == digests(ref.run_dir, *STEP1)
    assert digests(run_dir, "checkpoints") == digests(ref.run_dir, "checkpoints")
    assert executions(run_dir) == {(1, s): 2 for s in STAGES}  # the killed try and the finishing one
    assert [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == [0, 1]


# PPO with a critic (its checkpoint, its AdamW group), over 2 epochs, at a cosine learning rate
# after a warmup, rewards with an overlong penalty, and dynamic sampling drawing replacements
# for the prompts whose leaves all score alike (those of even index).
PPO = ["algo.name=ppo", "algo.critic=true", "algo.advantage=gae", "algo.epochs=2", "optim.schedule=cosine",
       "optim.warmup_steps=1", "algo.dynamic_sampling=true", "algo.dynamic_sampling_draws=3", "algo.overlong=penalty",
       "algo.overlong_buffer=2", "reward.function=tests.varied_rewards:alike_on_even_prompts", "drafter.enabled=false"]
# The same with LoRA adapters on every projection (their AdamW state beside the value head's)
# and a KL term to the base (the policy with its adapters off).
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "algo.kl_coef=0.1"]


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
def test_ppo_with_a_critic_a_schedule_and_dynamic_sampling_resumes_bit_identical(prefect_server, tiny_model_dir,
                                                                                 tmp_path, monkeypatch, lora):
    """A run stopped as step 1's rollouts start (an injected permanent error; the flow's
    process lets go of what it held, as a killed one would have) and resumed in a process
    that holds nothing: it draws step 1's trees and their replacements with the policy and
    critic of step 0's checkpoint, updates from there (both AdamW groups) at the same place
    in the schedule, and ends as an uninterrupted run, bit for bit. (SIGKILLs in each stage:
    the test above; here the state a PPO run resumes from.)"""
    from flows.train import train

    ref = tmp_path / "reference"
    train(overrides=[*tiny(ref, tiny_model_dir), *PPO, *lora])
    drawn = [json.loads((ref / f"step_{s:04d}/trees.done.json").read_text())["prompts_drawn"] for s in (0, 1)]
    assert max(drawn) > 1, drawn  # a tree was dropped and its prompt replaced
    run_dir = tmp_path / "run"
    monkeypatch.setenv("LSREPLAY_FAULTS", "trees@1:error")
    with pytest.raises(Exception, match="stage trees of step 1 failed"):
        train(overrides=[*tiny(run_dir, tiny_model_dir), *PPO, *lora])
    monkeypatch.delenv("LSREPLAY_FAULTS")
    assert not done(run_dir, 1, "trees") and done(run_dir, 0, "policy")
    train(resume=str(run_dir), overrides=[unique_pool()])
    assert (run_dir / "checkpoints/policy/step_0000/critic.safetensors").is_file()
    assert (run_dir / "checkpoints/policy/step_0000/adapter/adapter_model.safetensors").is_file() == bool(lora)
    assert digests(run_dir, "checkpoints", "step_0000", *STEP1) == digests(ref, "checkpoints", "step_0000", *STEP1)
    assert executions(run_dir)[(1, "trees")] == 2 and executions(run_dir)[(1, "policy")] == 1


def test_damaged_outputs_are_recomputed(prefect_server, tiny_model_dir, tmp_path_factory, tmp_path):
    """A flipped byte (same size: done() cannot see it) in step 1's trees and in step 0's
    policy checkpoint is caught by the sha256 check where they are read; the stages that
    wrote them run again and the run ends as the reference did."""
    from flows.train import train

    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = tmp_path / "run"
    shutil.copytree(ref.run_dir, run_dir)
    shutil.rmtree(run_dir / "executions")
    for stage in ("policy", "drafter"):  # step 1's update must run again: it reads both
        (run_dir / f"step_0001/{stage}.done.json").unlink()
    for path in ("step_0001/trees/shard_00.json", "checkpoints/policy/step_0000/model.safetensors"):
        data = bytearray((run_dir / path).read_bytes())
        data[-10] ^= 0xFF
        (run_dir / path).write_bytes(bytes(data))
    # A truncated file is caught by done() itself, before anything reads it.
    shard = run_dir / "step_0000/trees/shard_00.json"
    shard.write_bytes(shard.read_bytes()[:-1])
    cfg = load_config(None, tiny(run_dir, tiny_model_dir))
    assert Run(cfg).done(0, "trees-shard0") is None

    train(resume=str(run_dir), overrides=[unique_pool()])
    assert digests(run_dir, "step_0000", *STEP1) == digests(ref.run_dir, "step_0000", *STEP1)
    assert digests(run_dir, "checkpoints") == digests(ref.run_dir, "checkpoints")
    ran = executions(run_dir)
    # Step 0's truncated shard runs again. Step 1's caching pass finds its trees damaged,
    # so its trees run again; they find step 0's checkpoint damaged, which then no longer
    # counts as complete: the run restarts from the base model and step 0's caching pass and
    # update run again; then step 1's trees, caching pass, update and drafter. A try that
    # hit damage counts too.
    assert ran == {(0, "trees"): 1, (1, "prefixes"): 2, (1, "trees"): 2, (0, "prefixes"): 1, (0, "policy"): 1,
                   (1, "policy"): 1, (1, "drafter"): 1}, ran


def test_result_changing_config_is_refused_on_resume(tiny_model_dir, tmp_path_factory, prefect_server, capsys):
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    before = (ref.run_dir / "config.json").read_bytes()
    assert cli.main(["resume", str(ref.run_dir), "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: 0.001 -> 0.5" in err and "--force" in err, err
    assert cli.main(["train", *tiny(ref.run_dir, tiny_model_dir), "seed=7"]) == 2
    assert "seed: 0 -> 7" in capsys.readouterr().err
    assert (ref.run_dir / "config.json").read_bytes() == before
