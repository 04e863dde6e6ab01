"""The real vLLM engine with LoRA (model.lora.enabled with rollout.engine=vllm): it keeps the
base it started with and, after each update, takes only the policy's adapters (a PEFT
folder of kilobytes here), serving what transformers computes for the base with them. On a
Qwen2 (the other vLLM test modules run a Llama and a Qwen3): models.families.VLLM_TESTED."""

from __future__ import annotations

import torch

from peft import PeftModel

from lsreplay.core.config import ModelConfig
from lsreplay.models.distribution import SamplingParams
from lsreplay.models.loading import load_model
from test_vllm import teacher_forced
from vllm_models import needs_vllm, vllm_installed, vllm_qwen2_model_dir  # noqa: F401

pytestmark = needs_vllm


def sampled_gap(model, records: list[dict], sampling: SamplingParams) -> float:
    """The largest gap between the logprobs a step's rollouts were sampled with (from
    `sampling`'s distribution) and `model`'s."""
    gaps = [0.0]
    for record in records:
        for completion, logprobs in zip(record["completions"], record["logprobs"]):
            scored = teacher_forced(model, record["prompt_ids"], completion, sampling)
            gaps.append((torch.tensor(logprobs) - scored).abs().max().item())
    return max(gaps)


def test_a_lora_run_on_vllm_trains_its_adapters_and_the_engine_serves_them(prefect_server, vllm_qwen2_model_dir, tmp_path):
    """A real run (rollout.engine=vllm, model.lora): step 0's rollouts come from the engine's
    base, steps 1 and 2 from the base with the adapters of the update before (the engine
    took nothing else: step 2's under a second adapter id, which a stale first one would
    fail), and every step's logprob gap to the policy that acted is as small as with full
    weights: each step's samples are those of the PEFT folder its checkpoint before holds."""
    from flowrun import tree_records, unique_pool

    from flows.train import train
    from vllm_models import tiny_vllm_run

    run_dir = tmp_path / "run"
    metrics = train(overrides=tiny_vllm_run(run_dir, vllm_qwen2_model_dir, "rollout.engine=vllm", "steps=3",
                                            "model.lora.enabled=true", "model.lora.rank=8", "optim.lr=1e-2",
                                            "rollout.temperature=0.7", "rollout.top_k=40", "rollout.top_p=0.95",
                                            "drafter.enabled=false", "rollout.vllm.logprob_gap_every=1",
                                            "checkpoint.keep_last=3",
                                            unique_pool()))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert 0 < metrics[0]["engine_logprob_gap_mean"] < 1e-4  # a step that trains nothing measures no gap
    assert all(m["engine_logprob_gap_max"] < 1e-3 for m in metrics), metrics
    assert metrics[0]["grad_norm"] > 0 and metrics[1]["grad_norm"] > 0  # both updates moved the adapters
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=40)
    base = ModelConfig(path=str(vllm_qwen2_model_dir), dtype="float32")
    assert sampled_gap(load_model(base, trainable=False), tree_records(run_dir, 0), sampling) < 1e-4  # no adapter yet
    for step in (1, 2):  # by the base with the adapters of the update before, not by the base
        checkpoint = run_dir / f"checkpoints/policy/step_{step - 1:04d}/adapter"
        policy = PeftModel.from_pretrained(load_model(base, trainable=False), checkpoint)
        assert sampled_gap(policy, tree_records(run_dir, step), sampling) < 1e-4
        with policy.disable_adapter():
            assert sampled_gap(policy, tree_records(run_dir, step), sampling) > 1e-2
