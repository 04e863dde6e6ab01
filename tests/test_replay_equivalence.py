"""Replay equals the per-rollout reference for every loss over trees.

The same loss function is differentiated two ways: the replay path (caching-pass logprobs
-> dL/dlogp by autograd -> branch-replay backward with the captured prefix K/V) and the
naive path (per-rollout forward with grad -> loss -> backward). Loss values and every
parameter gradient must agree: per tensor max|diff| <= tol * max|grad|, tol 1e-6 in
float64 (HF's RMSNorm computes in float32 even then) and 1e-4 in float32.

The critic's losses are per-position losses on the last hidden state through a value
head, not weighted logprobs: `value` (the clipped value loss alone) and `ppo-critic` (PPO's
surrogate plus the value loss, both heads in one backward) replay through heads.

With LoRA (PEFT's adapters on every attention and MLP projection, lsreplay.models.lora) the
same holds, and only the adapters and the value head get gradients.
"""

import copy
import functools

import pytest
import torch
import transformers

from lsreplay.algos.backward import capture_logprobs, naive_loss_backward, replay_loss_backward
from lsreplay.algos.critic import VALUE, CriticBatch, attach_value_head, critic_heads, gae, value_loss
from lsreplay.algos.dpo import dpo_loss, reference_sequence_logprobs
from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.kl import reference_logprobs, with_kl
from lsreplay.algos.ppo import PPOBatch, ppo_loss
from lsreplay.core.config import ConfigError, LoraConfig
from lsreplay.models.lora import add_adapters, is_adapter
from lsreplay.models.distribution import RAW, SamplingParams
from lsreplay.replay.backward import replay_plan
from lsreplay.replay.cascade import cascade_applies
from lsreplay.replay.heads import logprob_heads
from lsreplay.replay.memory import KeptLayers, LayerByLayer
from lsreplay.tree import RolloutTree

TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
VOCAB = 64
MODELS = {
    # Llama with untied embeddings; Qwen2 with tied ones (and its q/k/v biases).
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, False),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, True),
}

# Completions per tree, built so the radix tree branches at several depths: leaves of
# different lengths, a completion ending where another continues, a duplicate, an empty one.
TREES = {
    1: [
        ([5, 6, 7, 8, 9], [[3, 4, 5], [6, 7], [8, 9, 10, 11, 12], [6, 7], [13]]),
        ([20, 21, 22, 23, 24, 25, 26, 27, 28], [[30, 31, 32, 33], [34], [35, 36, 37]]),
    ],
    2: [
        ([1, 2, 3, 4, 5, 6], [[1, 2, 3, 4], [1, 2, 5, 6, 7], [1, 2], [8, 9], [1, 2, 5, 6, 7]]),
        ([40, 41, 42], [[10, 11, 12, 13, 14, 15], [10, 11, 16], [17, 18, 19], [17, 18, 20, 21]]),
    ],
    3: [
        ([9, 8, 7, 6, 5, 4, 3], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 8], [1, 2, 3, 4], [30, 31],
                                 [1, 2, 3, 4, 5], []]),
        ([50, 51, 52, 53], [[40, 41, 42, 43], [40, 41, 42, 44, 45], [40, 46], [47]]),
        ([60, 61], [[1, 1, 1], [1, 1, 2, 3], [1, 4, 4, 4, 4, 4], [1, 1, 2, 5, 6]]),
    ],
}
LOSSES = ["grpo-token-mean", "grpo-seq-mean", "dr-grpo", "ppo", "kl-k1", "kl-k3", "dpo", "value", "ppo-critic"]



@functools.lru_cache(maxsize=None)
def _model(kind: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    config_cls, model_cls, tied = MODELS[kind]
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                        initializer_range=0.1)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # a peaked next-token distribution, as in a trained LM
        model.get_input_embeddings().weight.normal_(std=1.0)
    return model


@functools.lru_cache(maxsize=None)
def _reference(kind: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """A frozen reference near the policy (as after some training): the policy plus noise."""
    ref = copy.deepcopy(_model(kind, dtype))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    return ref


LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)  # every projection: q, k, v, o, gate, up, down


def fresh_model(kind, dtype, critic: bool = False, lora: bool = False):
    model = copy.deepcopy(_model(kind, dtype))
    if lora:  # B random too: at its initial zero, A would get no gradient
        add_adapters(model, LORA, seed=0)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=g, dtype=torch.float64))
    if critic:  # a random head: a zero one would send the trunk no gradient at all
        attach_value_head(model)
        with torch.no_grad():
            model.value_head.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    return model


def make_trees(depth: int) -> list[RolloutTree]:
    trees = [RolloutTree.from_sequences(p, c) for p, c in TREES[depth]]
    assert [t.depth for t in trees] == [depth] * len(trees)
    return trees


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_rel_diff(a: dict, b: dict) -> float:
    """Worst over tensors of max|a - b| / max|b|."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name in b:
        scale = b[name].abs().max().item()
        diff = (a[name] - b[name]).abs().max().item()
        assert scale > 0 or diff == 0, name
        worst = max(worst, diff / scale if scale else 0.0)
    return worst


def rewards_for(trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 3, (len(t.completions),), generator=g).double() for t in trees]


def token_advantages(trees, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(c), generator=g, dtype=torch.float64) for c in t.completions] for t in trees]


def critic_batch(model, trees, sampling: SamplingParams, clip=0.1):
    """Old values from the caching pass, GAE returns of random rewards; the model then moves
    one SGD step along the value loss's gradient, so that some values clip and some do not."""
    heads = critic_heads(sampling)
    scores, _ = capture_logprobs(model, trees, keep_kv=False, heads=heads)
    old = scores[VALUE]
    returns = [[gae(v, float(r), gamma=0.9, lam=0.8)[1] for v, r in zip(vs, rs)]
               for vs, rs in zip(old, rewards_for(trees))]
    batch = CriticBatch(old_values=old, returns=returns, clip=clip)
    replay_loss_backward(model, trees, lambda s: value_loss(s[VALUE], batch), heads=heads)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    torch.optim.SGD(model.parameters(), lr=0.01 / float(norm)).step()
    model.zero_grad(set_to_none=True)
    now, _ = capture_logprobs(model, trees, keep_kv=False, heads=heads)
    moved = torch.cat([(n - o).abs() for tn, to in zip(now[VALUE], old) for n, o in zip(tn, to)])
    return batch, {"clipped": float((moved > clip).double().mean())}


def build_loss(name: str, kind: str, dtype, model, trees, sampling: SamplingParams = RAW):
    """(loss_fn, heads, info) for `model` at its current weights, its logprobs those of the
    distribution `sampling` draws from. PPO first moves the model by one optimizer step away
    from the weights its old logprobs came from, the value losses one along the value loss."""
    if name in ("value", "ppo-critic"):
        batch, info = critic_batch(model, trees, sampling)
        if name == "value":
            return (lambda s: value_loss(s[VALUE], batch)), critic_heads(sampling), info
        old, _ = capture_logprobs(model, trees, keep_kv=False, heads=logprob_heads(sampling))
        ppo = PPOBatch(advantages=token_advantages(trees), old_logprobs=old, clip_eps=0.1, critic=batch, vf_coef=0.5)
        return (lambda s: ppo_loss(s, ppo)), critic_heads(sampling), info
    loss_fn, info = build_logprob_loss(name, kind, dtype, model, trees, sampling)
    return loss_fn, logprob_heads(sampling), info


def build_logprob_loss(name: str, kind: str, dtype, model, trees, sampling: SamplingParams):
    """Every logprob of the loss (old, reference, current) under `sampling`'s distribution."""
    heads = logprob_heads(sampling)
    old, _ = capture_logprobs(model, trees, keep_kv=False, heads=heads)
    adv = [group_advantages(r) for r in rewards_for(trees)]
    info = {}
    if name.startswith("grpo-"):
        batch = GRPOBatch(advantages=adv, old_logprobs=old, loss_agg=name[5:])
        return (lambda lp: grpo_loss(lp, batch)), info
    if name == "dr-grpo":
        adv = [group_advantages(r, scale=False) for r in rewards_for(trees)]
        batch = GRPOBatch(advantages=adv, old_logprobs=old, loss_agg="seq-mean-token-sum-norm", max_tokens=8)
        return (lambda lp: grpo_loss(lp, batch)), info
    if name == "ppo":
        batch = PPOBatch(advantages=token_advantages(trees), old_logprobs=old, clip_eps=0.1)
        # one SGD step of length 0.1 along the gradient: 30-90% of the tokens then clip
        replay_loss_backward(model, trees, lambda lp: ppo_loss(lp, batch), heads=heads)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.optim.SGD(model.parameters(), lr=0.1 / float(norm)).step()
        model.zero_grad(set_to_none=True)
        now, _ = capture_logprobs(model, trees, keep_kv=False, heads=heads)
        ratio = torch.cat([torch.exp(n - o) for tn, to in zip(now, old) for n, o in zip(tn, to)])
        info["clipped"] = float(((ratio - 1).abs() > batch.clip_eps).double().mean())
        return (lambda lp: ppo_loss(lp, batch)), info
    if name.startswith("kl-"):
        ref = reference_logprobs(_reference(kind, dtype), trees, sampling)
        batch = GRPOBatch(advantages=adv, old_logprobs=old)
        return with_kl(lambda lp: grpo_loss(lp, batch), ref, kl_coef=0.5, estimator=name[3:]), info
    if name == "dpo":
        ref = reference_sequence_logprobs(_reference(kind, dtype), trees, sampling)
        # pairs inside each tree, several sharing a completion prefix
        pairs = [[(0, 1), (2, 0), (len(t.completions) - 1, 1)] for t in trees]
        return (lambda lp: dpo_loss(lp, pairs, ref, beta=0.5)), info
    raise KeyError(name)


def compare(kind: str, dtype, depth: int, name: str, sampling: SamplingParams = RAW, budget: int | None = None,
            lora: bool = False, trees: list[RolloutTree] | None = None):
    model = fresh_model(kind, dtype, critic=name in ("value", "ppo-critic"), lora=lora)
    trees = trees or make_trees(depth)
    loss_fn, heads, info = build_loss(name, kind, dtype, model, trees, sampling)
    replay_loss, stats = replay_loss_backward(model, trees, loss_fn, heads=heads, budget_bytes=budget)
    replay = grads(model)
    naive_loss = naive_loss_backward(model, trees, loss_fn, heads=heads)
    naive = grads(model)
    return replay_loss, naive_loss, max_rel_diff(replay, naive), stats, info, naive


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_replay_matches_naive(dtype, kind, depth, name):
    replay_loss, naive_loss, rel, stats, info, _ = compare(kind, dtype, depth, name)
    tol = TOL[dtype]
    assert abs(replay_loss - naive_loss) <= tol * max(1.0, abs(naive_loss)), (replay_loss, naive_loss)
    assert rel <= tol, f"max relative gradient difference {rel:.3g} > {tol}"
    assert stats.positions < stats.per_rollout_positions  # replay shared something
    if name in ("ppo", "value", "ppo-critic"):  # the step moved the policy: some tokens clip, some do not
        assert 0.0 < info["clipped"] < 1.0, info


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_replay_exact_without_float32_norm(exact_rmsnorm, kind, name):
    """A far tighter check than 1e-6: with every op in float64, any replay error shows
    (measured: <= 2.1e-14 over all depths and losses)."""
    replay_loss, naive_loss, rel, *_ = compare(kind, torch.float64, 3, name)
    assert abs(replay_loss - naive_loss) <= 1e-12 * max(1.0, abs(naive_loss))
    assert rel <= 1e-11, rel


def kept_shares(kind: str, dtype, trees, budget: int | None) -> list[tuple[dict[int, KeptLayers], int]]:
    """Per tree at `budget`: the branching spans replay keeps, with what their layers keep
    (memory.kept_spans), and the number of branching spans."""
    model = _model(kind, dtype)
    out = []
    for tree in trees:
        try:
            spans, kept, _ = replay_plan(model, tree, 0, budget)
        except ConfigError:  # too small for any way of running the tree
            return []
        out.append((kept, sum(not s.is_leaf for s in spans)))
    return out


# What each path of the backward looks like in a tree's kept spans (and its branching spans).
PATHS = {
    "kept": lambda kept, branching: len(kept) == branching and all(k == KeptLayers() for k in kept.values()),
    "lean-layers": lambda kept, branching: any(isinstance(k, KeptLayers) and k.lean and not k.rerun
                                               for k in kept.values()),
    "layers-run-again": lambda kept, branching: any(isinstance(k, KeptLayers) and k.rerun for k in kept.values()),
    # On these trees a span recomputed after its subtree has kept ones beside it: alone, none
    # fits a budget that the others do not fit better.
    "recompute-and-kept": lambda kept, branching: 0 < len(kept) < branching,
}


def budget_for(kind: str, dtype, trees, path: str) -> int:
    """A budget at which some tree takes `path` (PATHS)."""
    for budget in (2**40, 1, *(int(1.25**k) for k in range(40, 120))):
        if any(PATHS[path](kept, branching) for kept, branching in kept_shares(kind, dtype, trees, budget)):
            return budget
    raise AssertionError(f"no budget takes the {path} path")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ["grpo-token-mean", "kl-k3", "dpo", "ppo-critic"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_path_of_the_backward_is_exact(exact_rmsnorm, kind, name, path):
    """Each branching node forwarded once with its whole graph kept, kept with some of its
    layers lean or run again whole in its backward (recompute.py), or kept and recomputed
    after its subtree nodes in one tree. (Run layer by layer: the test after next.)"""
    trees = make_trees(3)
    budget = budget_for(kind, torch.float64, trees, path)
    assert all(branching > 0 for _, branching in kept_shares(kind, torch.float64, trees, budget))
    replay_loss, naive_loss, rel, *_ = compare(kind, torch.float64, 3, name, budget=budget)
    assert abs(replay_loss - naive_loss) <= 1e-12 * max(1.0, abs(naive_loss))
    assert rel <= 1e-11, rel


@pytest.mark.parametrize("path", ["kept", "recompute-and-kept", "layer-by-layer"])
@pytest.mark.parametrize("name", ["grpo-token-mean", "kl-k3", "ppo-critic"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_replay_is_exact_with_lora_on_every_projection(exact_rmsnorm, kind, name, path):
    """PEFT's lora.Linear in every projection: the attention modules still take replay's
    cascade attention, and the gradients of the adapters (and of the value head, which
    trains in full beside them) are exactly the per-rollout ones; the base gets none."""
    model = fresh_model(kind, torch.float64, lora=True)
    assert cascade_applies(model)
    adapted = {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert len(adapted) == 2 * 7 * model.config.num_hidden_layers
    trees = long_trees(2) if path == "layer-by-layer" else make_trees(3)
    budget = layer_by_layer_budget(kind, trees) if path == "layer-by-layer" else budget_for(kind, torch.float64,
                                                                                             trees, path)
    replay_loss, naive_loss, rel, _, _, naive = compare(kind, torch.float64, 3, name, budget=budget, lora=True,
                                                        trees=trees)
    critic = {"value_head.weight", "value_head.bias"} if name == "ppo-critic" else set()
    assert set(naive) == adapted | critic
    assert abs(replay_loss - naive_loss) <= 1e-12 * max(1.0, abs(naive_loss))
    assert rel <= 1e-11, rel


def long_trees(depth: int, seed: int = 0) -> list[RolloutTree]:
    """A tree of `depth` whose branching spans are long next to its leaves (a 96-token prompt,
    then spans of 64 and 48 tokens, two children each, leaves of 3 and 4 tokens, one of them a
    duplicate): where its spans' graphs do not fit, they run layer by layer."""
    g = torch.Generator().manual_seed(seed)

    def grow(level: int) -> list[list[int]]:
        if level == depth:
            return [[]]
        out = []
        for f in range(2):
            length = (64, 48)[level] if level < depth - 1 else 3 + f
            segment = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            out += [segment + rest for rest in grow(level + 1)]
        return out

    completions = grow(0)
    tree = RolloutTree.from_sequences(torch.randint(0, VOCAB, (96,), generator=g).tolist(),
                                      completions + completions[:1])
    assert tree.depth == depth
    return [tree]


def layer_by_layer_budget(kind: str, trees: list[RolloutTree]) -> int:
    """The least budget (of a geometric series) at which every branching span runs layer by
    layer, in chunks shorter than itself."""
    for budget in (int(50_000 * 1.05**k) for k in range(100)):
        shares = kept_shares(kind, torch.float64, trees, budget)
        if shares and all(len(kept) == branching and all(isinstance(k, LayerByLayer) for k in kept.values())
                          for kept, branching in shares):
            spans = [replay_plan(_model(kind, torch.float64), t, 0, budget)[0] for t in trees]
            if all(k.chunk < len(s[i].tokens) for (kept, _), s in zip(shares, spans) for i, k in kept.items()):
                return budget
    raise AssertionError("no budget runs every branching span layer by layer in chunks")


@pytest.mark.parametrize("name", ["grpo-token-mean", "ppo-critic", "value"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("kind", list(MODELS))
def test_spans_run_layer_by_layer_are_exact(exact_rmsnorm, kind, depth, name):
    """Every branching span's forward keeping its layer inputs and K/V, its backward running
    each layer again from the top in chunks shorter than the span (layerwise.py), the
    subtree's dK/dV entering at each layer: GRPO, and PPO with a critic whose values are
    scored on the prompt's descendants (the value loss alone too)."""
    trees = long_trees(depth)
    budget = layer_by_layer_budget(kind, trees)
    replay_loss, naive_loss, rel, stats, *_ = compare(kind, torch.float64, depth, name, budget=budget, trees=trees)
    assert abs(replay_loss - naive_loss) <= 1e-12 * max(1.0, abs(naive_loss))
    assert rel <= 1e-11, rel
    assert sum(t.unique_positions for t in trees) <= stats.positions < stats.per_rollout_positions


# Rollouts drawn at temperature 0.7 from the top 40 tokens' nucleus of 0.9 (on a 64-token
# vocabulary the nucleus cuts, the top-k too on flat rows).
TEMPERED = SamplingParams(temperature=0.7, top_p=0.9, top_k=40)


@pytest.mark.parametrize("name", ["grpo-token-mean", "kl-k3", "dpo", "ppo-critic"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_replay_matches_naive_under_the_tempered_truncated_distribution(kind, name):
    """Scored as sampled: both paths differentiate the logprobs of the distribution the
    rollouts came from, and the gradient is not the untempered one's."""
    replay_loss, naive_loss, rel, _, _, tempered = compare(kind, torch.float64, 3, name, TEMPERED)
    assert abs(replay_loss - naive_loss) <= 1e-6 * max(1.0, abs(naive_loss)), (replay_loss, naive_loss)
    assert rel <= 1e-6, f"max relative gradient difference {rel:.3g} > 1e-6"
    raw = compare(kind, torch.float64, 3, name)[-1]
    assert max_rel_diff(tempered, raw) > 1e-2  # the temperature and the cut change the gradient


@pytest.mark.parametrize("name", ["kl-k3", "dpo"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_bfloat16_smoke(kind, name):
    """bf16 is noisy (8-bit mantissa; the two computation orders round differently): only
    check that replay runs and points the same way as the reference. Measured over GRPO,
    PPO, KL and DPO on the depth-3 trees: cosine similarity >= 0.9989 per tensor,
    max|diff|/max|grad| up to 6e-2, losses equal to 4 digits."""
    model = fresh_model(kind, torch.bfloat16)
    trees = make_trees(3)
    loss_fn, heads, _ = build_loss(name, kind, torch.bfloat16, model, trees)
    replay_loss, _ = replay_loss_backward(model, trees, loss_fn, heads=heads)
    replay = grads(model)
    naive_loss = naive_loss_backward(model, trees, loss_fn, heads=heads)
    naive = grads(model)
    assert abs(replay_loss - naive_loss) <= 2e-2 * max(1.0, abs(naive_loss))
    assert replay.keys() == naive.keys()
    for name in naive:
        a, b = replay[name].double().flatten(), naive[name].double().flatten()
        if b.abs().max() == 0:
            assert a.abs().max() == 0, name
            continue
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert cos > 0.99, (name, cos)
