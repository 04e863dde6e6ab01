"""A whole training flow on the long-context task at a 32k-token prompt, on CPU: a tiny random
model (model.arch) whose 2,048 rotary positions YaRN stretches past 32k (model.rope_scaling),
one step of every stage. The rollouts hold the prompt's K/V once and show the prefill's
progress; replay computes the prompt once for its 4 rollouts; the step's record carries its
peak memory."""

import logging

from flowrun import tree_records, unique_pool

from lsreplay.core.config import load_config
from lsreplay.models.loading import hf_config
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position

PROMPT_TOKENS = 32768
# One head of 16 over two layers: attention over 32k positions dominates a model this small,
# and the CPU kernel runs one wide head several times faster than many narrow ones.
ARCH = ("model.arch={model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2, "
        "num_attention_heads: 1, num_key_value_heads: 1, vocab_size: 49152}")


def test_a_32k_token_prompt_trains_end_to_end(prefect_server, tmp_path, caplog):
    from flows.train import train

    overrides = [f"run_dir={tmp_path / 'run'}", ARCH, "model.rope_scaling={rope_type: yarn, factor: 17}", "steps=1",
                 "data.tasks=[kv_retrieval]", "data.size=2", "data.prompts_per_step=1",
                 f"data.max_prompt_tokens={PROMPT_TOKENS}", "rollout.branching=[2,2]", "rollout.segment_tokens=[2]",
                 "rollout.max_new_tokens=4", "drafter.steps=1", "drafter.batch_size=1", "optim.lr=1e-3",
                 # A random model never finds the needle: a reward that differs between its answers makes the
                 # step train, so that the replay backward runs over the 32k-token prompt.
                 "reward.functions=[varied_rewards:code_parity]", unique_pool()]
    with caplog.at_level(logging.INFO, logger="lsreplay.rollout.shared_prompt"):
        metrics = train(overrides=overrides)
    [tree] = tree_records(tmp_path / "run", 0)
    prompt = len(tree["prompt_ids"])
    assert PROMPT_TOKENS - 16 <= prompt <= PROMPT_TOKENS
    assert f"prefill of prompt 1/1: 4096/{prompt} positions" in caplog.text  # a long prefill shows its progress
    [m] = metrics
    assert m["grad_norm"] > 0  # the update trained (GRPO's first loss is 0: ratios of 1, advantages summing to 0)
    # Replay computed the prompt once for the 4 rollouts that share it.
    assert m["per_rollout_positions"] >= 4 * prompt and m["positions"] <= prompt + 4 * 4
    # The step's peak memory: the replay backward's saved activations and held K/V, and the
    # rollouts' K/V, the prompt's once (4 rows would hold 4 copies).
    cfg = load_config(None, overrides)
    per_position = kv_bytes_per_position(ModelDims.from_hf(hf_config(cfg.model)), 4)
    assert prompt * per_position <= m["kv_bytes_peak"] < (prompt + 4 * cfg.rollout.max_new_tokens) * per_position
    assert m["peak_activation_bytes"] > prompt * per_position
