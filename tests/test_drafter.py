"""Drafter model and distillation on tiny random Llama and Qwen2 targets."""

import json

import pytest
import torch
import transformers
from conftest import tiny_model

from lsreplay.drafter.distill import distill, evaluate, sequences_to_batch
from lsreplay.drafter.model import Drafter


def _tiny_target(kind: str) -> transformers.PreTrainedModel:
    model = tiny_model(kind, vocab=128, dtype=torch.float32, tie_word_embeddings=True, initializer_range=0.2)
    # At the default 0.02 init the model is near-uniform and its argmax hardly moves with
    # the context, so there is nothing to learn; a large-norm (tied) embedding makes the
    # next token sharp and token-driven, as in a trained LM.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)
    return model


@torch.no_grad()
def _rollouts(target, count: int, seed: int, prompt_len: int = 8, new_tokens: int = 24):
    """Sampled paths (tokens, features), cut to different lengths so batches need padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(target.config.vocab_size, (count, prompt_len), generator=generator)
    for _ in range(new_tokens):
        probs = target(ids).logits[:, -1].softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    features = target.base_model(ids).last_hidden_state
    lengths = [prompt_len + 12 + i % (new_tokens - 11) for i in range(count)]
    return [(ids[i, :n], features[i, :n]) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    target = _tiny_target(request.param)
    return target, _rollouts(target, 128, seed=1), _rollouts(target, 32, seed=2)


def _fresh_drafter(target) -> Drafter:
    torch.manual_seed(1)
    return Drafter.from_target(target)


def test_shared_heads_stay_out_of_drafter_and_get_no_grad(setup):
    target, train, _ = setup
    drafter = _fresh_drafter(target)
    assert not [k for k in drafter.state_dict() if "embed" in k or "lm_head" in k]
    target_ids = {id(p) for p in target.parameters()}
    assert not [p for p in drafter.parameters() if id(p) in target_ids]
    distill(drafter, train, steps=2, lr=1e-3, batch_size=4, generator=torch.Generator().manual_seed(0), progress=False)
    assert all(p.grad is None for p in target.parameters())
    # The drafter reads the shared weights detached; the policy keeps training them.
    assert all(p.requires_grad for p in target.parameters())


def test_drafter_follows_target_dtype():
    target = _tiny_target("llama").to(torch.float64)
    drafter = Drafter.from_target(target)
    assert {p.dtype for p in drafter.parameters()} == {torch.float64}
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32


def test_distill_beats_untrained_on_held_out(setup):
    target, train, held_out = setup
    drafter = _fresh_drafter(target)
    before = evaluate(drafter, held_out)
    stats = distill(drafter, train, steps=150, lr=3e-3, batch_size=8, generator=torch.Generator().manual_seed(0), progress=False)
    after = evaluate(drafter, held_out)
    assert stats.steps == 150
    assert after.loss < 0.5 * before.loss
    assert after.feature_loss < before.feature_loss and after.token_loss < before.token_loss
    assert after.top1_accept > before.top1_accept + 0.3, (before, after)


def test_cached_steps_match_full_forward(setup):
    target, train, _ = setup
    drafter = _fresh_drafter(target)
    batch = sequences_to_batch(train[:3], max_len=64)
    args = batch["input_ids"], batch["hidden_states"], batch["position_ids"]
    with torch.no_grad():
        full = drafter(*args)
        for chunks in ([1] * full.shape[1], [5, 1, 3, 2, 1]):
            cache, start, parts = transformers.DynamicCache(), 0, []
            for size in chunks:
                parts.append(drafter(*(a[:, start : start + size] for a in args), cache=cache))
                start += size
            torch.testing.assert_close(torch.cat(parts, dim=1), full[:, :start], atol=1e-5, rtol=1e-5)
            assert cache.get_seq_length() == start


def test_distill_is_deterministic(setup):
    target, train, _ = setup

    def run(seed: int) -> dict[str, torch.Tensor]:
        drafter = _fresh_drafter(target)
        distill(drafter, train, steps=10, lr=3e-3, batch_size=4, generator=torch.Generator().manual_seed(seed), progress=False)
        return drafter.state_dict()

    first, second, other = run(7), run(7), run(8)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_sequences_to_batch_shifts_pads_and_keeps_the_end():
    tokens = [torch.arange(5), torch.arange(10, 13), torch.arange(20, 30)]
    sequences = [(t, t.float()[:, None].expand(-1, 4)) for t in tokens]
    batch = sequences_to_batch(sequences, max_len=6)
    assert batch["mask"].sum(1).tolist() == [4, 2, 6]
    assert batch["input_ids"][0, :4].tolist() == [1, 2, 3, 4]
    assert batch["hidden_states"][1, :2, 0].tolist() == [10.0, 11.0]
    assert batch["position_ids"][1].tolist() == list(range(6))
    # A path longer than max_len keeps its last pairs (the completion), at their real positions.
    assert batch["target_hidden_next"][2, :, 0].tolist() == [24.0, 25.0, 26.0, 27.0, 28.0, 29.0]
    assert batch["input_ids"][2].tolist() == [24, 25, 26, 27, 28, 29]
    assert batch["position_ids"][2].tolist() == [3, 4, 5, 6, 7, 8]


def test_config_dict_rebuilds_the_drafter(setup):
    target, train, _ = setup
    drafter = _fresh_drafter(target)
    config = json.loads(json.dumps(drafter.config_dict()))
    torch.manual_seed(99)
    rebuilt = Drafter.from_config_dict(target, config)
    rebuilt.load_state_dict(drafter.state_dict())
    batch = sequences_to_batch(train[:2], max_len=16)
    args = batch["input_ids"], batch["hidden_states"], batch["position_ids"]
    with torch.no_grad():
        assert torch.equal(rebuilt(*args), drafter(*args))
    with pytest.raises(ValueError):
        Drafter.from_config_dict(target, {**config, "hidden_size": 64})


def test_a_bf16_drafter_trains_on_float32_masters():
    """AdamW on bf16 weights rounds an update of lr 1e-3 away (half a bf16 ulp of 1.0 is
    3.9e-3 above it, 2e-3 below): the fc's pass-through entries (1.0) never moved. On float32
    masters the steps add up, and the compute weights follow them."""
    from lsreplay.drafter.distill import drafter_train_state

    target = _tiny_target("llama").to(torch.bfloat16)
    drafter = _fresh_drafter(target)
    ones = drafter.fc.weight == 1
    assert drafter.fc.weight.dtype == torch.bfloat16 and ones.any()
    train = drafter_train_state(drafter, lr=1e-3)
    distill(drafter, _rollouts(target, 16, seed=1), steps=6, lr=1e-3, batch_size=4,
            generator=torch.Generator().manual_seed(0), train=train, progress=False)
    fc = train.masters[train.names.index("fc.weight")]
    assert fc.dtype == torch.float32 and bool((fc[ones] != 1).all())
    assert bool((drafter.fc.weight[ones] != 1).any())
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(train.params, train.masters))
