"""The real vLLM engine with LoRA (model.lora.enabled with rollout.engine=vllm): it keeps the
base it started with and, after each update, takes only the policy's adapters (a PEFT
folder of kilobytes here), serving what transformers computes for the base with them."""

from __future__ import annotations

import torch

from lsreplay.core.config import LoraConfig, ModelConfig
from lsreplay.models.distribution import SamplingParams
from lsreplay.models.lora import adapters_off, add_adapters, is_adapter
from lsreplay.models.loading import load_model
from lsreplay.rollout.vllm_engine import VLLMEngine
from test_vllm import spec, teacher_forced
from vllm_models import held_out_prompts, needs_vllm, vllm_installed, vllm_model_dir  # noqa: F401

pytestmark = needs_vllm

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)


def engine_gaps(engine: VLLMEngine, policy, prompts: list[list[int]], eos: int) -> tuple[float, float]:
    """The largest gap between the engine's logprobs of its own samples and the trainer's
    (`policy` teacher-forced), and the same against `policy`'s base."""
    trees, _ = engine.sample_trees(prompts, [2], [], 12, SAMPLING.temperature, SAMPLING.top_p, SAMPLING.top_k, [eos])
    gaps, base_gaps = [0.0], [0.0]
    for prompt, tree in zip(prompts, trees):
        for completion, logprobs in zip(tree.completions, tree.logprobs):
            served = torch.tensor(logprobs)
            gaps.append((served - teacher_forced(policy, prompt, completion, SAMPLING)).abs().max().item())
            with adapters_off(policy):
                base_gaps.append((served - teacher_forced(policy, prompt, completion, SAMPLING)).abs().max().item())
    return max(gaps), max(base_gaps)


def test_a_lora_engine_follows_the_adapters_of_each_update_and_keeps_its_base(vllm_model_dir):
    cfg = ModelConfig(path=str(vllm_model_dir), dtype="float32", lora=LoraConfig(enabled=True, rank=8, alpha=16))
    policy = add_adapters(load_model(cfg, device="cpu"), cfg.lora, seed=0)
    eos = policy.generation_config.eos_token_id
    prompts = held_out_prompts(vllm_model_dir, 3)
    engine = VLLMEngine(spec(vllm_model_dir, lora_rank=8))
    generator = torch.Generator().manual_seed(0)
    try:
        gap, _ = engine_gaps(engine, policy, prompts, eos)  # B = 0: the policy is its base, no adapter sent yet
        assert gap < 1e-4
        for _ in range(2):  # two updates: the second replaces the first's adapters (a stale one fails the gap)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if is_adapter(name):
                        p.add_(torch.randn(p.shape, generator=generator) * 0.1)
            engine.load_adapters(policy, cfg)
            gap, base_gap = engine_gaps(engine, policy, prompts, eos)
            assert gap < 1e-4, gap  # as small as with full weights (tests/test_vllm.py)
            assert base_gap > 1e-2, base_gap  # and the adapters changed what it serves
    finally:
        engine.close()


def base_gap(model, records: list[dict], sampling: SamplingParams) -> float:
    """The largest gap between the logprobs a step's rollouts were sampled with (from
    `sampling`'s distribution) and `model`'s."""
    gaps = [0.0]
    for record in records:
        for completion, logprobs in zip(record["completions"], record["logprobs"]):
            scored = teacher_forced(model, record["prompt_ids"], completion, sampling)
            gaps.append((torch.tensor(logprobs) - scored).abs().max().item())
    return max(gaps)


def test_a_lora_run_on_vllm_trains_its_adapters_and_the_engine_serves_them(prefect_server, vllm_model_dir, tmp_path):
    """A real run (rollout.engine=vllm, model.lora): step 0's rollouts come from the engine's
    base, step 1's from the base with the adapters of step 0's update (the engine took
    nothing else), and every step's logprob gap is as small as with full weights; the
    checkpoint is a PEFT folder."""
    from flowrun import tree_records, unique_pool

    from flows.train import train
    from vllm_models import tiny_vllm_run

    run_dir = tmp_path / "run"
    metrics = train(overrides=tiny_vllm_run(run_dir, vllm_model_dir, "rollout.engine=vllm", "steps=2",
                                            "model.lora.enabled=true", "model.lora.rank=8", "optim.lr=3e-2",
                                            "rollout.temperature=0.7", "rollout.top_k=40", "rollout.top_p=0.95",
                                            "drafter.enabled=false", "rollout.vllm.logprob_gap_every=1",
                                            unique_pool()))
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:  # against the policy that acted in the step
        assert 0 < m["engine_logprob_gap_mean"] < 1e-4 and m["engine_logprob_gap_max"] < 1e-3, m
    assert metrics[0]["grad_norm"] > 0
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=40)
    base = load_model(ModelConfig(path=str(vllm_model_dir), dtype="float32"), trainable=False)
    assert base_gap(base, tree_records(run_dir, 0), sampling) < 1e-4  # sampled by the base: no adapter yet
    assert base_gap(base, tree_records(run_dir, 1), sampling) > 1e-2  # not by the base: by the updated adapters
    adapter = run_dir / "checkpoints/policy/step_0001/adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
