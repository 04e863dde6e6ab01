"""Real runs with rollout.engine=vllm: the trees stage samples multi-turn episodes on a vLLM
engine that follows the policy and speculates with the run's spot-trained drafter; the
training-inference logprob gap is measured every step, over the tokens the model sampled;
an engine killed in the middle of a call is replaced by the stage's retry; a run killed in a
stage resumes and loses nothing. One run shows all of it: an engine's start-up is most of a
tiny run's time on CPU. (Single answers on vLLM run through the same stage in
tests/test_vllm_lora.py.)"""

from __future__ import annotations

import json

from flowrun import lsreplay_chain, stall_until_drafter_checkpointed, tree_records, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from vllm_models import needs_vllm, tiny_vllm_run, vllm_ending_model_dir, vllm_installed, vllm_model_dir  # noqa: F401

pytestmark = needs_vllm

VLLM = ["rollout.engine=vllm", "rollout.spec_threshold=8", "rollout.draft_lens=[0,2]"]
# Episodes of up to 2 replies: the environment says "Wrong, try again." (the tiny model never
# answers right) to a reply that ended (vllm_ending_model_dir's often do), and its second reply
# is sampled on the same engine.
EPISODES = ["rollout.max_turns=2", "rollout.environment=lsreplay.data.agentic.ArithmeticFeedback"]


def manifest(run_dir, step: int, stage: str) -> dict:
    return json.loads((run_dir / f"step_{step:04d}" / f"{stage}.done.json").read_text())


def test_vllm_episodes_follow_the_policy_speculate_with_the_runs_drafter_and_resume(prefect_server,
                                                                                  vllm_ending_model_dir, tmp_path,
                                                                                  monkeypatch):
    """Episodes of up to two turns. Step 0's engine is SIGKILLed in the middle of a shard's
    call: the shards that used it fail, and their retries start a fresh engine whose episodes
    are right (the step's logprob gap over the model's tokens: the environment's have none).
    Step 1's second shard straggles, so step 0's drafter trains on the slot the first frees
    and step 2 speculates with it; the run is killed in the middle of step 2's rollouts and
    resumed: steps 0 and 1 stand as they were, step 2's episodes are sampled again (vLLM's
    samples cannot be reproduced), and every step has its metrics and checkpoint. (The other
    stages resume as with the HF engine, tests/test_resume.py: they read the stored trees,
    whichever engine wrote them.)"""
    run_dir = tmp_path / "run"
    stall_until_drafter_checkpointed(monkeypatch, run_dir)  # the straggler holds its slot until then
    run = tiny_vllm_run(run_dir, vllm_ending_model_dir, *VLLM, *EPISODES, "steps=3", "rollout.shards=2", "pool.slots=2",
                        "data.prompts_per_step=2", "drafter.steps=4", "drafter.batch_size=4",
                        "drafter.checkpoint_every=2", "drafter.lr=1e-2", "algo.tis_cap=2", "rollout.temperature=0.7",
                        "rollout.top_k=40", "rollout.top_p=0.95", "rollout.vllm.logprob_gap_every=1")
    killed, finished = lsreplay_chain([(["train", *run, unique_pool()], "trees@0:kill_engine,trees@1:stall,trees@2:kill"),
                                       (["resume", str(run_dir), unique_pool()], "")], tmp_path)
    assert killed["returncode"] == -9, killed["log"][-3000:]
    assert finished["returncode"] == 0 and "Traceback" not in finished["log"], finished["log"][-3000:]
    executions = Run(load_config(None, [f"run_dir={run_dir}"])).executions()
    assert executions[(1, "trees")] == 2  # two shards, once each
    assert executions[(0, "trees")] > 2  # a shard whose engine was killed ran again
    assert "injected kill of the vLLM engine" in killed["log"] and "engine process ended during" in killed["log"]
    assert executions[(2, "trees")] > 2  # the killed shard sampled again
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:  # vLLM's float32 logprobs of the tempered, cut distribution are the trainer's to a few 1e-5
        assert 0 < m["engine_logprob_gap_mean"] < 1e-4 and m["engine_logprob_gap_max"] < 1e-3, m
        assert 0 <= m["tis_capped_fraction"] < 0.01 and abs(m["tis_weight_mean"] - 1) < 1e-3, m
        assert m["grad_norm"] > 0
    assert (run_dir / "checkpoints/policy/step_0002/checkpoint.json").is_file()
    assert (run_dir / "checkpoints/policy/step_0002/hf/model.safetensors").is_file()
    trees = tree_records(run_dir, 1)
    assert all(sum(t["counts"]) == 8 and len(t["paths"]) == len(t["completions"]) for t in trees)
    # Some replies ended and were told to try again: their second reply followed the environment's tokens.
    assert max(t for step in range(3) for r in tree_records(run_dir, step) for t in r["turns"]) == 2
    assert any(0 < m["episodes/environment_token_share"] < 1 and m["episodes/turns_mean"] > 1 for m in metrics), metrics
    # Spot-trained during step 1's rollouts (a drafter that found them over trains nothing), at
    # least to its first checkpoint, which ended the stall.
    assert manifest(run_dir, 0, "drafter")["steps_done"] >= 2
    rollouts = manifest(run_dir, 2, "trees-shard0")
    assert rollouts["engine"] == "vllm" and rollouts["drafter_step"] == 0
    # The prefix cache served branches and second turns (every turn's requests counted).
    assert 0 < rollouts["cached_positions"] < rollouts["prompt_positions"]
    assert rollouts["spec_rounds"] > 0 and rollouts["accept_len"] >= 1  # it speculated in the tail
    assert manifest(run_dir, 0, "trees-shard0")["spec_rounds"] == 0  # no drafter before step 2
