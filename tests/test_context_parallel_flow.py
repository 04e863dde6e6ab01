"""A run whose update splits each prompt over two gloo ranks (replay.context_parallel=2) trains;
killed twice in step 1's update, first one of its ranks (the stage's try fails and is retried
from the step's start, nothing of it applied), then the whole flow's process, and resumed, it
ends with the weights of an uninterrupted run, bit for bit."""

from __future__ import annotations

import json

from flowrun import digests, lsreplay_chain, tiny, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.run import Run

# Every tree's prompt (a chat-templated question, over 16 tokens) split over the update's two ranks.
SPLIT = ["pool.slots=2", "pool.devices_per_step=2", "replay.context_parallel=2", "replay.context_parallel_tokens=16",
         "drafter.enabled=false", "reward.function=tests.varied_rewards:code_parity"]


def test_split_prompts_train_and_resume_bit_identical(prefect_server, tiny_model_dir, tmp_path):
    from flows.train import train

    ref = tmp_path / "reference"
    train(overrides=[*tiny(ref, tiny_model_dir), *SPLIT])
    for step in (0, 1):
        policy = json.loads((ref / f"step_{step:04d}/policy.done.json").read_text())
        # The prompt ran layer by layer in two shares (one device keeps its graph at this budget).
        assert policy["ranks"] == 2 and policy["layer_by_layer_positions"] > 0, policy

    run_dir = tmp_path / "run"
    killed, resumed = lsreplay_chain([(["train", *tiny(run_dir, tiny_model_dir), *SPLIT], "policy@1:kill_rank,policy@1:kill"),
                                      (["resume", str(run_dir), unique_pool()], "")], tmp_path, threads=1)
    assert killed["returncode"] == -9, killed["log"][-3000:]
    assert "injected kill of rank 1 of stage policy of step 1" in killed["log"]
    assert "injected kill in the middle of stage policy of step 1" in killed["log"]
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    assert digests(run_dir, "checkpoints") == digests(ref, "checkpoints")
    runs = Run(load_config(None, [f"run_dir={run_dir}"])).executions()
    assert runs[(1, "policy")] == 3  # the try a rank died in, the one the flow was killed in, the resumed one
