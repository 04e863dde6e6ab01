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
