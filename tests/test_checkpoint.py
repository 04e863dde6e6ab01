"""Tests for lsreplay.state.checkpoint: exact round trips of a tied-weight Llama, AdamW state and
RNG states, on a local directory and on S3, and clear errors for damaged checkpoints."""

import pytest
import torch
from conftest import tiny_model
from transformers import LlamaForCausalLM

from lsreplay.core.storage import Store
from lsreplay.state.checkpoint import (
    CheckpointError,
    load_module,
    load_optimizer,
    load_rng,
    save_module,
    save_optimizer,
    save_rng,
)

VOCAB = 128


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    return tiny_model(vocab=VOCAB, dtype=torch.float32, seed=seed, tie_word_embeddings=True, **overrides)


def train_step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_module_round_trip_keeps_ties(store):
    model = tiny_llama(0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    manifest = save_module(store, "step_1/policy", model, meta={"step": 1})
    assert set(manifest["files"]) == {"model.safetensors", "meta.json"}
    saved = store.read_tensors("step_1/policy/model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    assert store.read_json("step_1/policy/meta.json") == {"step": 1}

    fresh = tiny_llama(1)
    load_module(store, "step_1/policy", fresh, manifest)
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_adamw_round_trip_is_exact(store):
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for seed in (1, 2):
        train_step(model, optimizer, seed)
    model_manifest = save_module(store, "ckpt/policy", model)
    opt_manifest = save_optimizer(store, "ckpt/optim", optimizer)

    model2 = tiny_llama(5)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, betas=(0.8, 0.95))
    load_module(store, "ckpt/policy", model2, model_manifest)
    load_optimizer(store, "ckpt/optim", optimizer2, opt_manifest)
    saved, loaded = optimizer.state_dict(), optimizer2.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for index in saved["state"]:
        assert_same_state(saved["state"][index], loaded["state"][index])

    train_step(model, optimizer, 3)
    train_step(model2, optimizer2, 3)
    assert_same_state(model.state_dict(), model2.state_dict())


def test_optimizer_without_state_round_trips(tmp_path):
    store = Store(str(tmp_path))
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    save_optimizer(store, "o", optimizer)
    fresh = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    load_optimizer(store, "o", fresh)
    assert fresh.state_dict() == optimizer.state_dict()


def test_optimizer_for_other_parameters_is_refused(tmp_path):
    store = Store(str(tmp_path))
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    save_optimizer(store, "o", optimizer)
    with pytest.raises(CheckpointError, match="same parameter groups"):
        load_optimizer(store, "o", torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))


def test_rng_round_trip(store):
    generator = torch.Generator().manual_seed(7)
    torch.rand(3, generator=generator)
    manifest = save_rng(store, "rng", {"sampler": generator})
    expected = torch.rand(5, generator=generator)
    states = load_rng(store, "rng", manifest)
    assert states["sampler"].dtype == torch.uint8
    generator.set_state(states["sampler"])
    assert torch.equal(torch.rand(5, generator=generator), expected)


def test_truncated_model_file_names_the_file(store):
    manifest = save_module(store, "p", tiny_llama(0))
    data = store.read_bytes("p/model.safetensors")
    store.write_bytes("p/model.safetensors", data[: len(data) // 3])
    for given in (None, manifest):
        with pytest.raises(CheckpointError, match="p/model.safetensors"):
            load_module(store, "p", tiny_llama(1), given)


def test_missing_checkpoint_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="absent/model.safetensors"):
        load_module(Store(str(tmp_path)), "absent", tiny_llama(0))


def test_other_architecture_is_refused_and_left_untouched(tmp_path):
    store = Store(str(tmp_path))
    save_module(store, "p", tiny_llama(0, num_hidden_layers=1))
    target = tiny_llama(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys \['model\.layers\.1\."):
        load_module(store, "p", target)
    assert_same_state(before, target.state_dict())


def test_manifest_of_another_checkpoint_is_refused(tmp_path):
    store = Store(str(tmp_path))
    manifest = save_module(store, "a", tiny_llama(0))
    save_module(store, "b", tiny_llama(1))
    with pytest.raises(CheckpointError, match="manifest"):
        load_module(store, "b", tiny_llama(2), manifest)
