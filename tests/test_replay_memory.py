"""Activation memory: the ActivationMeter itself, and replay's peak as trees get wider.

Replay holds one root-to-leaf path of activations plus its ancestors' K/V and runs sibling
leaves in micro-batches sized to that, so its peak must not grow with the number of
leaves; the per-rollout reference runs one sequence at a time, so neither does its peak,
but it runs the prompt again for every leaf. Counted with ActivationMeter (bytes saved
for backward + held K/V), which is deterministic, unlike process memory.
"""

import gc
import itertools
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import RAW_LOGPROB

from lsreplay.core.config import ConfigError
from lsreplay.models.distribution import RAW
from lsreplay.replay import ActivationMeter, naive_backward, replay_backward
from lsreplay.replay.backward import replay_plan
from lsreplay.replay.capture import capture_tree
from lsreplay.replay.cascade import forward_cascade
from lsreplay.replay.layerwise import LayerByLayerSpan
from lsreplay.replay.memory import (KeptLayers, ModelDims, kept_bytes, layer_by_layer_bytes, layer_run_bytes,
                                    saved_bytes, top_run_bytes)
from lsreplay.replay.recompute import recomputed_layers
from lsreplay.replay.segments import concat_kv, forward_segments, kv_bytes, new_kv, target_logprobs
from lsreplay.tree import RolloutTree

VOCAB = 256
PROMPT, SUFFIX = 256, 32
LEAVES = (8, 16, 32)


def _llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The tests' 2-layer Llama (4 query heads, 2 K/V heads), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return _llama()


def _tree(leaves: int, seed: int = 0) -> RolloutTree:
    """`leaves` completions of SUFFIX tokens after one PROMPT; distinct first tokens, so
    the trie is exactly a root with `leaves` leaf children."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
    firsts = rng.sample(range(VOCAB), leaves)
    completions = [[f] + [rng.randrange(VOCAB) for _ in range(SUFFIX - 1)] for f in firsts]
    return RolloutTree.from_sequences(prompt, completions)


def _weights(tree: RolloutTree) -> list:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(len(c), generator=gen, dtype=torch.float64) for c in tree.completions]]


@pytest.fixture(scope="module")
def measured(model):
    out = {}
    for g in LEAVES:
        tree = _tree(g)
        acts = capture_tree(model, tree, keep_hidden=False, heads=RAW_LOGPROB)
        weights = _weights(tree)
        model.zero_grad(set_to_none=True)
        replay = replay_backward(model, [tree], weights, prefix_kv=lambda i, node, acts=acts: acts.prefix_kv.get(node.id),
                                 meter=ActivationMeter(model), heads=RAW_LOGPROB)
        model.zero_grad(set_to_none=True)
        naive = naive_backward(model, [tree], weights, meter=ActivationMeter(model), heads=RAW_LOGPROB)
        model.zero_grad(set_to_none=True)
        out[g] = (tree, replay, naive)
    return out


def test_replay_peak_stays_within_the_per_rollout_peak_as_leaves_double(model, measured):
    """The default budget is what the per-rollout backward saves for one rollout: however many
    leaves, replay's peak (a kept prompt, some of its layers run again, leaves in micro-batches
    of what room is left) stays under it, and under the per-rollout backward's measured peak."""
    budget = replay_plan(model, measured[LEAVES[0]][0])[2]  # the same for every G: one rollout's
    for g in LEAVES:
        _, replay, naive = measured[g]
        assert 0 < replay.peak_activation_bytes <= budget, (g, replay.peak_activation_bytes, budget)
        assert replay.peak_activation_bytes <= naive.peak_activation_bytes, g
    assert budget == pytest.approx(measured[LEAVES[0]][2].peak_activation_bytes, rel=0.01)


def test_naive_peak_flat_but_replay_positions_scale_with_leaves(measured):
    naive_peaks = {g: measured[g][2].peak_activation_bytes for g in LEAVES}
    for small, big in itertools.pairwise(LEAVES):
        # One sequence of PROMPT + SUFFIX positions at a time, whatever the number of leaves.
        assert naive_peaks[big] == pytest.approx(naive_peaks[small], rel=0.01), naive_peaks
    for g in LEAVES:
        tree, replay, naive = measured[g]
        assert replay.positions == tree.unique_positions == PROMPT + g * SUFFIX
        assert naive.positions == tree.total_positions == g * (PROMPT + SUFFIX)
        assert replay.positions_ratio == pytest.approx(g * (PROMPT + SUFFIX) / (PROMPT + g * SUFFIX))


# -- the meter itself ----------------------------------------------------------------------

def test_meter_counts_saved_tensors_and_frees_them_after_backward():
    linear = torch.nn.Linear(100, 50, bias=False)
    meter = ActivationMeter(linear)
    x = torch.randn(8, 100, requires_grad=True)
    nbytes = 8 * 100 * 4
    with meter.measure():
        y = torch.sin(x)  # saves its input
        assert meter.current == nbytes
        z = y * y  # saves y twice: one storage, counted once
        assert meter.current == 2 * nbytes
        out = linear(z)  # saves z and the weight; parameters are not activations
        assert meter.current == 3 * nbytes
    out.sum().backward()
    assert meter.current == 0
    assert meter.peak == 3 * nbytes


def test_meter_frees_a_graph_dropped_without_backward_and_counts_held_buffers():
    meter = ActivationMeter()
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    with meter.measure():
        y = torch.sin(x)  # saves its input
    assert meter.current == 8000
    del y
    assert meter.current == 0
    with meter.hold(500):
        assert meter.current == 500
    assert meter.current == 0
    assert meter.peak == 8000


def test_meter_frees_a_saved_output_dropped_without_backward():
    meter = ActivationMeter()
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    with meter.measure():
        y = x.exp()  # saves its output
    assert meter.current == 8000
    del y
    gc.collect()
    assert meter.current == 0


def test_meter_ignores_work_without_grad():
    meter = ActivationMeter()
    x = torch.randn(1000, requires_grad=True)
    with meter.measure(), torch.no_grad():
        x.sin()
    assert meter.current == meter.peak == 0


def test_meter_counts_a_held_tensor_once_when_autograd_saves_it():
    meter = ActivationMeter()
    held = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    with meter.hold(100, tensors=[held]), meter.measure():
        assert meter.current == 8100
        y = held.sin()  # saves its input, the held tensor: stored once, counted once
        assert meter.current == 8100
        del y
    assert meter.current == 0
    assert meter.peak == 8100


# -- the byte model of a cascade-attention run (see memory.saved_bytes) ----------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("lengths", [[20], [20, 13, 7]], ids=["node", "leaves"])
def test_cascade_run_saves_what_the_byte_model_counts(dtype, lengths):
    """What autograd keeps for a run on two ancestors' K/V held by replay (a branching node
    recomputed, or a micro-batch of right-padded leaves), scored on every real position."""
    model = _llama(dtype)
    config = model.config
    rng = random.Random(0)
    ancestors = [[rng.randrange(VOCAB) for _ in range(n)] for n in (40, 24)]
    prefix, start = [], 0
    with torch.no_grad():
        for seg in ancestors:
            _, cache = forward_segments(model, [seg], start, concat_kv(prefix))
            prefix.append(tuple([t.clone().requires_grad_() for t in half] for half in new_kv(cache, start)))
            start += len(seg)
    held = [t for kv in prefix for half in kv for t in half]
    segments = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    entries = sum(n - 1 for n in lengths)
    meter = ActivationMeter(model)
    with meter.hold(0, tensors=held), meter.measure():
        held_bytes = meter.current
        hidden, _ = forward_cascade(model, segments, start, prefix)
        objective = sum(target_logprobs(model, hidden[row], range(len(seg) - 1), seg[1:], sampling=RAW).sum()
                        for row, seg in enumerate(segments))
        saved = meter.current - held_bytes
    objective.backward()
    elt = torch.tensor([], dtype=dtype).element_size()
    expected = saved_bytes(ModelDims.from_hf(config), elt, len(lengths), max(lengths), start, entries, cascade=True)
    assert saved == expected  # byte for byte


# -- what a kept span holds (memory.kept_bytes), its layers whole, lean or run again ----------

@pytest.mark.parametrize("layers", [KeptLayers(), KeptLayers(0, 2), KeptLayers(0, 1), KeptLayers(2, 0), KeptLayers(1, 1)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("ancestors", [0, 1], ids=["prompt", "after-prompt"])
def test_kept_span_holds_what_the_byte_model_counts(dtype, ancestors, layers):
    """A branching span forwarded with grad as kept_node does it (recompute.py's layers),
    with a child run on its K/V as leaf tensors: what the meter counts is the span's
    kept_bytes and the child's saved_bytes, byte for byte; the backward then gives every
    weight the gradient of the span's whole graph kept."""
    model = _llama(dtype)
    config = model.config
    rng = random.Random(0)
    prompt, span, child = ([rng.randrange(VOCAB) for _ in range(n)] for n in (30, 12, 7))
    prefix = []
    if ancestors:
        with torch.no_grad():
            _, cache = forward_segments(model, [prompt], 0, None)
        prefix = [tuple([t.clone().requires_grad_() for t in half] for half in new_kv(cache, 0))]
    start = len(prompt) if ancestors else 0
    grads = {}
    for kept in (KeptLayers(), layers):
        meter = ActivationMeter(model)
        with meter.hold(0, tensors=[t for kv in prefix for half in kv for t in half]), meter.measure():
            base = meter.current
            with recomputed_layers(model, kept, meter):
                hidden, cache = (forward_cascade(model, [span], start, prefix) if prefix
                                 else forward_segments(model, [span], 0, None))
            own = new_kv(cache, 0)
            objective = hidden.sum()  # saves nothing
            kv = tuple([t.detach().requires_grad_() for t in half] for half in own)
            below, _ = forward_cascade(model, [child], start + len(span), [*prefix, kv])
            child_objective = target_logprobs(model, below[0], range(len(child) - 1), child[1:], sampling=RAW).sum()
            held = meter.current - base
            child_objective.backward()
            torch.autograd.backward([objective, *own[0], *own[1]],
                                    [torch.ones_like(objective), *(t.grad for half in kv for t in half)])
        grads[kept] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        dims, elt = ModelDims.from_hf(config), torch.tensor([], dtype=dtype).element_size()
        assert held == (kept_bytes(dims, elt, len(span), start, 0, kept, cascade=bool(prefix), ancestors=ancestors)
                        + saved_bytes(dims, elt, 1, len(child), start + len(span), len(child) - 1, cascade=True))
    whole, less = grads[KeptLayers()], grads[layers]
    assert all(torch.equal(whole[n], less[n]) for n in whole)


# -- what a span run layer by layer holds (memory.layer_by_layer_bytes, layerwise.py) ---------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("ancestors", [0, 1], ids=["prompt", "after-prompt"])
def test_span_run_layer_by_layer_holds_what_the_byte_model_counts(dtype, ancestors):
    """A branching span run layer by layer as replay does it, a child on its K/V: from its
    forward on the meter counts layer_by_layer_bytes; differentiating its entries' scores
    adds top_run_bytes; its backward adds its K/V's gradient and one layer over one chunk
    (layer_run_bytes), byte for byte."""
    model = _llama(dtype)
    dims, elt = ModelDims.from_hf(model.config), torch.tensor([], dtype=dtype).element_size()
    rng = random.Random(0)
    prompt, span, child = ([rng.randrange(VOCAB) for _ in range(n)] for n in (30, 40, 5))
    prefix, start = [], 0
    if ancestors:
        with torch.no_grad():
            _, cache = forward_segments(model, [prompt], 0, None)
        prefix, start = [tuple([t.clone().requires_grad_() for t in half] for half in new_kv(cache, 0))], len(prompt)
    entries = [37, 38, 39, 39]  # the last position predicts two children's first tokens
    chunk = 8
    meter = ActivationMeter(model)
    with meter.hold(0, tensors=[t for kv in prefix for half in kv for t in half]), meter.measure():
        base = meter.current
        run = LayerByLayerSpan(model, span, start, prefix, chunk, meter)
        score = lambda hidden, ids, rows, targets: target_logprobs(model, hidden, rows, targets, RAW).sum()  # noqa: E731
        kv = run.forward(score, list(range(len(entries))), entries, [1, 2, 3, 4])
        held, top, grads = meter.current - base, meter.peak - base, kv_bytes(kv)
        with meter.hold(grads):
            below, _ = forward_cascade(model, [child], start + len(span), [*prefix, kv])
            target_logprobs(model, below[0], range(len(child) - 1), child[1:], RAW).sum().backward()
            meter.peak = meter.current
            run.backward()
            again = meter.peak - base - held - grads
    assert held == layer_by_layer_bytes(dims, elt, len(span))
    assert top - held == top_run_bytes(dims, elt, rows=3, entries=4)
    assert again == layer_run_bytes(dims, elt, chunk)


def test_replay_holds_its_budget_as_the_prompt_grows_and_refuses_past_it():
    """At one budget, longer and longer prompts (4 leaves of SUFFIX tokens): replay's peak
    stays within it, the prompt run layer by layer once its graph does not fit, while the
    per-rollout backward's grows past it; where even the prompt's layer inputs and K/V do
    not fit, replay refuses, naming replay.budget_mb and the budget it needs."""
    model = _llama()
    budget = 3 * 2**20
    for prompt in (128, 256, 512, 960):
        rng = random.Random(prompt)
        tree = RolloutTree.from_sequences([rng.randrange(VOCAB) for _ in range(prompt)], _tree(4).completions)
        weights = _weights(tree)
        model.zero_grad(set_to_none=True)
        replay = replay_backward(model, [tree], weights, budget_bytes=budget, meter=ActivationMeter(model),
                                 heads=RAW_LOGPROB)
        model.zero_grad(set_to_none=True)
        naive = naive_backward(model, [tree], weights, meter=ActivationMeter(model), heads=RAW_LOGPROB)
        assert replay.peak_activation_bytes <= budget, prompt
        assert (naive.peak_activation_bytes > budget) == (prompt >= 256), prompt
        assert replay.layer_by_layer_positions == (prompt if prompt >= 512 else 0), prompt
    with pytest.raises(ConfigError, match=r"replay.budget_mb=1 is too small .* raise replay.budget_mb to at least 2,"):
        replay_backward(model, [tree], weights, budget_bytes=2**20, heads=RAW_LOGPROB)


def test_offload_prefix_on_a_cpu_changes_nothing():
    """replay.offload_prefix on a CPU: the same code path, no copies: the same choice, peak
    and gradients, bit for bit, as without it."""
    model = _llama()
    rng = random.Random(0)
    tree = RolloutTree.from_sequences([rng.randrange(VOCAB) for _ in range(512)], _tree(4).completions)
    weights = _weights(tree)
    runs = {}
    for offload in (False, True):
        assert replay_plan(model, tree, 0, 3 * 2**20, offload)[1] == replay_plan(model, tree, 0, 3 * 2**20)[1]
        model.zero_grad(set_to_none=True)
        stats = replay_backward(model, [tree], weights, budget_bytes=3 * 2**20, meter=ActivationMeter(model),
                                heads=RAW_LOGPROB, offload_prefix=offload)
        runs[offload] = stats, {n: p.grad.clone() for n, p in model.named_parameters()}
    (off, grads_off), (on, grads_on) = runs[False], runs[True]
    assert on.layer_by_layer_positions == off.layer_by_layer_positions == 512
    assert on.peak_activation_bytes == off.peak_activation_bytes
    assert all(torch.equal(grads_on[n], grads_off[n]) for n in grads_off)
