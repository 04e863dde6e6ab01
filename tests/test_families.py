"""The family matrix: every model family replay trains, exact against the family's own
forward and backward in float64, or refused at the preflight.

A family is in lsreplay.models.families' allow-list only with an entry here (tests/families.py
builds its tiny model with windows, chunks, softcaps and scales set so that they matter).
Each is checked on both ways replay runs a branch: cascade attention at the default budget
(branching nodes forwarded once with grad, some of their layers lean or run again), and
HF's own attention over a copy of the prefix at a budget so small that every branching node
takes its K/V as leaf tensors and runs again after its subtree. The reference is the
family's causal LM itself: `model(ids).logits`, per completion, forward and backward.
"""

import copy
from pathlib import Path

import pytest
import torch
from conftest import RAW_LOGPROB
from families import HYBRIDS, MATRIX, arch, hf_config, tiny

import lsreplay.replay.backward as replay_module
from lsreplay.core.config import Config, ConfigError, ModelConfig
from lsreplay.models.families import FAMILIES, family
from lsreplay.models.hf_compat import decoder
from lsreplay.models.loading import ModelError, load_model
from lsreplay.models.logits import float_logits
from lsreplay.replay import replay_backward
from lsreplay.replay.capture import capture_tree
from lsreplay.replay.cascade import cascade_applies
from lsreplay.replay.layerwise import layer_by_layer_applies
from lsreplay.replay.memory import LayerByLayer
from lsreplay.stages.preflight import preflight
from lsreplay.tree import RolloutTree

# A depth-3 tree whose sequences run past the windows: a completion that is a prefix of
# another, a duplicate, an empty one.
PROMPT = [9, 8, 7, 6, 5, 4, 3, 10, 11]
COMPLETIONS = [[12, 13, 14, 15, 16], [12, 13, 14, 15, 17, 18, 19, 20], [12, 13, 21], [12, 13, 14, 15],
               [30, 31, 32, 33, 34, 35], [12, 13, 14, 15, 16], []]
TINY_BUDGET = 20_000  # bytes: no branching node's graph fits


def test_every_supported_family_is_in_the_matrix():
    assert set(FAMILIES) == set(MATRIX)


def per_token_weights(tree: RolloutTree) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(len(c), generator=g, dtype=torch.float64) for c in tree.completions]]


def family_gradient(model, tree: RolloutTree, weights) -> dict[str, torch.Tensor]:
    """The weighted logprob gradient through the family's causal LM, one completion at a time."""
    model.zero_grad()
    for j, completion in enumerate(tree.completions):
        if completion:
            logits = model(input_ids=torch.tensor([tree.prompt_ids + completion])).logits[0].double()
            at = torch.arange(tree.prompt_len - 1, tree.prompt_len - 1 + len(completion))
            logprobs = logits[at].log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            (logprobs * weights[0][j]).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def worst_relative_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[name] - w).abs().max() / w.abs().max().clamp(min=1e-30)) for name, w in want.items())


@pytest.mark.parametrize("path", ["cascade", "segments"])
@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_replay_equals_the_family_forward_and_backward(model_type, path, monkeypatch):
    model = copy.deepcopy(tiny(model_type))
    tree = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    weights = per_token_weights(tree)
    want = family_gradient(model, tree, weights)
    if path == "segments":  # HF's own attention over a copy of the prefix, every node recomputed
        monkeypatch.setattr(replay_module, "cascade_applies", lambda m: False)
    elif not cascade_applies(model):
        pytest.skip(f"{model_type} runs on HF's own attention (models/families.py: cascade=False)")
    model.zero_grad()
    replay_backward(model, [tree], weights, budget_bytes=TINY_BUDGET if path == "segments" else None,
                    heads=RAW_LOGPROB)
    got = {name: p.grad for name, p in model.named_parameters()}
    assert worst_relative_gap(got, want) <= 1e-6


def layer_by_layer_tree() -> RolloutTree:
    """A 40-token prompt, two 16-token segments after it, two short leaves after each: long
    spans next to their leaves, which run layer by layer where their graphs do not fit."""
    g = torch.Generator().manual_seed(2)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 64, (n,), generator=g).tolist()

    segments = [tokens(16), tokens(16)]
    return RolloutTree.from_sequences(tokens(40), [s + tokens(n) for s in segments for n in (2, 3)])


@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_spans_run_layer_by_layer_equal_the_family_forward_and_backward(model_type):
    """The prompt and the segments after it run layer by layer (replay/layerwise.py), in
    chunks shorter than each, at the least budget (of a geometric series) that takes them so,
    through the family's own decoder layers and cascade attention's windows, softcaps, sinks
    and latent attention."""
    model = copy.deepcopy(tiny(model_type))
    if not cascade_applies(model):
        pytest.skip(f"{model_type} runs on HF's own attention (models/families.py: cascade=False)")
    if not layer_by_layer_applies(model):  # Gemma 4: its per-layer inputs come from weights of their own
        assert model_type == "gemma4_text" and not runs_layer_by_layer(model, layer_by_layer_tree(), 10**9)
        pytest.skip(f"{model_type}'s decoder layers take inputs other weights compute: the fallback instead")
    tree = layer_by_layer_tree()
    weights = per_token_weights(tree)
    want = family_gradient(model, tree, weights)
    budget = next(b for b in (int(20_000 * 1.05**k) for k in range(150)) if runs_layer_by_layer(model, tree, b))
    model.zero_grad()
    stats = replay_backward(model, [tree], weights, budget_bytes=budget, heads=RAW_LOGPROB)
    assert stats.layer_by_layer_positions == 40 + 2 * 16
    got = {name: p.grad for name, p in model.named_parameters()}
    assert worst_relative_gap(got, want) <= 1e-6


def runs_layer_by_layer(model, tree: RolloutTree, budget: int) -> bool:
    """Whether at `budget` every branching span of `tree` runs layer by layer in chunks
    shorter than itself."""
    try:
        spans, kept, _ = replay_module.replay_plan(model, tree, 0, budget)
    except ConfigError:
        return False
    branching = [s for s in spans if not s.is_leaf]
    return all(isinstance(kept.get(s.id), LayerByLayer) and kept[s.id].chunk < len(s.tokens) for s in branching)


@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_the_caching_pass_and_the_logits_are_the_family_ones(model_type):
    """lsreplay's logits (the family's softcap or scale after the LM head) and the caching
    pass's logprobs of every entry, against the family's causal LM."""
    model = tiny(model_type)
    ids = torch.tensor([PROMPT + COMPLETIONS[1]])
    with torch.no_grad():
        want = model(input_ids=ids).logits.double()
        got = float_logits(model, decoder(model)(input_ids=ids).last_hidden_state)
    # Float64 but for HF's norms, which compute in float32 (DESIGN.md: 1e-7 relative).
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    tree = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    scores = capture_tree(model, tree, keep_hidden=False, heads=RAW_LOGPROB).entry_logprobs
    for j, completion in enumerate(tree.completions):
        if completion:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([PROMPT + completion])).logits[0].double()
            at = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(completion))
            expected = logits[at].log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            assert torch.allclose(scores[tree.entry_index[j]], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_hybrid_families_are_refused_naming_what_is_missing(model_type):
    with pytest.raises(ModelError, match="linear-attention or state-space layers"):
        family(hf_config(model_type))


def test_a_family_outside_the_matrix_is_refused():
    with pytest.raises(ModelError, match=r"'gpt_neox' is not among the families replay is tested exact on"):
        family(hf_config("gpt_neox", head_dim=None))


def test_gemma4_sharing_keys_and_values_across_layers_is_refused():
    config = hf_config("gemma4_text", num_hidden_layers=6, num_kv_shared_layers=2,
                       layer_types=["sliding_attention", "full_attention"] * 3)
    with pytest.raises(ModelError, match="num_kv_shared_layers"):
        family(config)


def test_the_preflight_refuses_a_hybrid_before_any_rollout(tmp_path):
    cfg = Config(run_dir=str(tmp_path / "run"), model=ModelConfig(arch=arch("qwen3_5_text")))
    with pytest.raises(ModelError, match="Qwen3.5: their linear-attention"):
        preflight(cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("step_*"))


def test_a_family_without_sdpa_attention_loads_with_eager():
    """Gemma 2 softcaps its attention logits, which sdpa cannot: model.attn_implementation=sdpa
    (the default) loads it with eager attention rather than failing."""
    model = load_model(ModelConfig(arch=arch("gemma2"), dtype="float64"), trainable=False)
    assert model.config._attn_implementation == "eager"


def test_the_docs_name_every_supported_family():
    page = (Path(__file__).resolve().parents[1] / "docs/models.md").read_text()
    assert [t for t in FAMILIES if f"(`{t}`)" not in page] == []
