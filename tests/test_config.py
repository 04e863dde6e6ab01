"""Config loading: defaults, overrides, and errors that name the key and what is allowed."""

import pytest

from lsreplay.config import ConfigError, load_config, result_hash, to_dict, to_yaml


@pytest.mark.parametrize("override, message", [
    ("model.pth=x", "unknown config key 'model.pth'; allowed keys under 'model': path, dtype"),
    ("foo=1", "unknown config key 'foo'; allowed keys at the top level: run_dir"),
    ("steps=abc", "config key 'steps'"),
    ("model.dtype=int8", "one of float32, float64, bfloat16"),
    ("rollout.segment_tokens=[1,2]", "exactly len(rollout.branching) - 1 = 1 values"),
    ("algo.loss_agg=mean", "token-mean or seq-mean or seq-mean-token-sum-norm"),
    ("algo.tree_baseline=siblings", "independent or group"),
    ("rollout.branching=[1,8]", "independent needs rollout.branching[0] >= 2"),
    ("optim.lr=inf", "a finite number > 0"),
    ("replay.kv_offload=disk", "store or host"),
    ("pool.devices_per_step=3", "between 1 and pool.slots = 1"),
    ("steps", "is not key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_defaults_file_and_overrides_merge():
    cfg = load_config("configs/default.yaml", ["steps=2", "rollout.branching=[8,2]"])
    assert cfg.steps == 2 and cfg.rollout.branching == [8, 2] and cfg.data.tasks == ["basic_arithmetic", "chain_sum"]


def test_secrets_are_redacted_and_do_not_change_the_result_hash():
    a = load_config(None, ["storage.key=AKIAXYZ", "storage.secret=s3cr3t"])
    b = load_config(None, [])
    assert "s3cr3t" not in to_yaml(a) and to_dict(a)["storage"]["secret"] == "***"
    assert result_hash(a) == result_hash(b)
    assert result_hash(load_config(None, ["optim.lr=2e-5"])) != result_hash(b)


def test_random_init_model_of_a_given_shape():
    from lsreplay.models import load_model

    cfg = load_config(None, ["model.arch={model_type: qwen2, hidden_size: 32, intermediate_size: 64, "
                             "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 100}"])
    model = load_model(cfg.model)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 100
