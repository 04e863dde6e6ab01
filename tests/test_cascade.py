"""Cascade attention (lsreplay/replay/cascade.py): the attention itself against sdpa over the
prefix repeated per row, a model forward on it against `forward_segments`, and the replay
backward, which runs it, against the per-rollout reference. Without a GPU, the CUDA kernels
(attention/kernels.py) are checked through their shape functions only; the CUDA cases run
where a GPU is (`pytest tests/test_cascade.py -k cuda`)."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.profiler import ProfilerActivity, profile

from conftest import RAW_LOGPROB

from lsreplay.replay import ActivationMeter, naive_backward, replay_backward
from lsreplay.replay.attention.kernels import CUDA_EFFICIENT, CUDA_FLASH, kernel_for
from lsreplay.replay.backward import _Replay
from lsreplay.replay.cascade import _CascadeAttention, _Plan, cascade_applies, forward_cascade
from lsreplay.replay.segments import concat_kv, forward_segments, new_kv
from lsreplay.tree import RolloutTree

VOCAB = 64
ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def on_cuda(*values):
    """A parameter set that needs a CUDA device to run."""
    marks = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.param("cuda", *values, marks=marks, id="-".join(["cuda", *map(str, values)]))


def reference_attention(scale, query, key, value, *prefix):
    """sdpa over [prefix repeated per row; the row's own], K/V repeated to every query head,
    causal on the own part."""
    rows, heads, width, _ = query.shape
    keys = torch.cat([k.expand(rows, -1, -1, -1) for k in prefix[0::2]] + [key], dim=2)
    values = torch.cat([v.expand(rows, -1, -1, -1) for v in prefix[1::2]] + [value], dim=2)
    past = keys.shape[2] - width
    mask = torch.ones(width, past + width, dtype=torch.bool, device=query.device).tril(past)
    group = heads // key.shape[1]
    return F.scaled_dot_product_attention(query, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=scale)


def cascade(kernel, scale, query, key, value, *prefix):
    """Cascade attention with one kernel for every part and no masks or sinks."""
    plan = _Plan(scale, kernel, None, [(kernel, None)] * (len(prefix) // 2))
    return _CascadeAttention.apply(plan, query, key, value, None, *prefix)


def attention_inputs(heads, kv_heads, prefix_lengths, dtype, device="cpu"):
    """query, own key, own value of 3 rows of width 6, laid out as HF attention produces them
    ((rows, width, heads, d) transposed), then each ancestor's key and value; all leaves."""
    g = torch.Generator().manual_seed(0)
    rows, width, dim = 3, 6, 16

    def rand(*shape):
        if device == "meta":
            return torch.empty(*shape, dtype=dtype, device=device)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    own = [rand(rows, width, h, dim).transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads)]
    return own + [rand(1, kv_heads, n, dim).requires_grad_() for n in prefix_lengths for _ in "kv"]


SHAPES = pytest.mark.parametrize("heads, kv_heads, prefix_lengths", [(8, 2, (11, 5)), (4, 4, (9,))], ids=["gqa", "mha"])


@SHAPES
@pytest.mark.parametrize("device, dtype, tol", [
    ("cpu", torch.float64, 1e-12), ("cpu", torch.float32, 5e-6),
    on_cuda(torch.float32, 1e-4), on_cuda(torch.bfloat16, 3e-2), on_cuda(torch.float16, 5e-3)])
def test_cascade_attention_equals_sdpa_over_the_repeated_prefix(heads, kv_heads, prefix_lengths, device, dtype, tol):
    """Output and every input's gradient against the reference in float64, through the
    device's kernel for the dtype."""
    inputs = attention_inputs(heads, kv_heads, prefix_lengths, dtype, device)
    scale = inputs[0].shape[-1] ** -0.5
    exact = [t.detach().double().requires_grad_() for t in inputs]
    out = cascade(kernel_for(device, dtype, inputs[0].shape[-1]), scale, *inputs)
    expected = reference_attention(scale, *exact)
    assert out.dtype == dtype
    assert (out.double() - expected).abs().max() < tol * max(1.0, expected.abs().max().item())
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
    expected_grads = torch.autograd.grad(expected, exact, grad_out)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() < tol * max(1.0, want.abs().max().item())


@SHAPES
@pytest.mark.parametrize("kernel, dtype", [(CUDA_FLASH, torch.bfloat16), (CUDA_FLASH, torch.float16),
                                           (CUDA_EFFICIENT, torch.float32)], ids=["flash-bf16", "flash-f16", "eff-f32"])
def test_cuda_kernels_fit_the_cascade_function_on_meta_tensors(heads, kv_heads, prefix_lengths, kernel, dtype):
    """No GPU here: on meta tensors the CUDA ops run their shape functions, which checks the
    calls against the ops' schemas and that what they return (the efficient kernel pads its
    log-sum-exp rows to a multiple of 32) fits the fold, the merge and the backward. Their
    numbers are for a GPU check."""
    inputs = attention_inputs(heads, kv_heads, prefix_lengths, dtype, device="meta")
    out = cascade(kernel, inputs[0].shape[-1] ** -0.5, *inputs)
    assert (out.shape, out.dtype) == (inputs[0].shape, dtype)
    grads = torch.autograd.grad(out, inputs, torch.empty_like(out))
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in inputs]


def tiny(arch: str, dtype=torch.float64, **overrides) -> transformers.PreTrainedModel:
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    dims = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.1, attn_implementation="sdpa") | overrides
    return model_cls(config_cls(**dims)).to(dtype).eval()


def prefix_kv(model, segments: list[list[int]]) -> list:
    """Each segment's K/V after the ones before it, as replay holds them: leaf tensors."""
    parts, start = [], 0
    with torch.no_grad():
        for seg in segments:
            _, cache = forward_segments(model, [seg], start, concat_kv(parts))
            parts.append(tuple([t.clone().requires_grad_() for t in half] for half in new_kv(cache, start)))
            start += len(seg)
    return parts


def hidden_and_grads(model, forward, segments, prefix):
    """Real (unpadded) positions' hidden states of right-padded `segments` after `prefix`,
    and the gradient of a fixed random function of them w.r.t. the prefix K/V and the weights."""
    hidden, _ = forward(model, segments, sum(part[0][0].shape[-2] for part in prefix), prefix)
    real = torch.cat([hidden[row, : len(seg)] for row, seg in enumerate(segments)])
    probe = torch.randn(real.shape, generator=torch.Generator().manual_seed(2), dtype=real.dtype).to(real.device)
    (real * probe).sum().backward()
    leaves = [t for part in prefix for half in part for t in half] + list(model.base_model.parameters())
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return real.detach(), grads


def sdpa_forward(model, segments, start, prefix):
    return forward_segments(model, segments, start, concat_kv(prefix))


@pytest.mark.parametrize("arch, kv_heads", [("llama", 2), ("qwen2", 4)], ids=["llama-gqa", "qwen2-mha"])
def test_forward_cascade_equals_forward_segments_on_right_padded_rows(arch, kv_heads):
    model = tiny(arch, num_key_value_heads=kv_heads)
    prefix = prefix_kv(model, [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]])
    segments = [[11, 12, 13, 14, 15], [16, 17, 18], [19, 20, 21, 22, 23, 24, 25]]
    hidden, grads = hidden_and_grads(model, forward_cascade, segments, prefix)
    expected, expected_grads = hidden_and_grads(model, sdpa_forward, segments, prefix)
    # Float64 throughout but HF's RMSNorm, which rounds to float32 (measured: equal hidden
    # states, gradients within 1e-15).
    assert (hidden - expected).abs().max() <= 1e-7 * expected.abs().max()
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max() <= 1e-9 * want.abs().max()


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), on_cuda(torch.bfloat16), on_cuda(torch.float16)])
def test_half_precision_cascade_forward_close_to_sdpa(device, dtype):
    model = tiny("qwen2", dtype).to(device)
    prefix = prefix_kv(model, [list(range(1, 30))])
    segments = [list(range(30, 41)), list(range(41, 47))]
    hidden, _ = hidden_and_grads(model, forward_cascade, segments, prefix)
    expected, _ = hidden_and_grads(model, sdpa_forward, segments, prefix)
    assert torch.nn.functional.cosine_similarity(hidden.float().flatten(), expected.float().flatten(), dim=0) > 0.999


def tree() -> RolloutTree:
    """Branches at two depths; leaves of different lengths under each branching node."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    completions = [[10, 11, 12, 13], [10, 11, 14], [10, 11, 15, 16, 17, 18], [20, 21], [20, 22, 23, 24, 25], [30]]
    return RolloutTree.from_sequences(prompt, completions)


def replay_vs_naive(model) -> tuple[float, int]:
    """Max relative gradient difference of replay vs naive, and how many times replay ran
    cascade attention (seen by the profiler: no stand-in involved)."""
    t = tree()
    weights = [[torch.randn(len(c), generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                for i, c in enumerate(t.completions)]]
    model.zero_grad(set_to_none=True)
    naive_backward(model, [t], weights, heads=RAW_LOGPROB)
    naive = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    # A budget that holds all siblings: one micro-batch of leaves per node.
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        replay_backward(model, [t], weights, budget_bytes=2**30, heads=RAW_LOGPROB)
    calls = sum(e.count for e in prof.key_averages() if e.key == "_CascadeAttention")
    rel = max(((p.grad - g).abs().max() / g.abs().max()).item() for p, g in zip(model.parameters(), naive))
    return rel, calls


@pytest.mark.parametrize("device, dtype, tol", [("cpu", torch.float64, 1e-6), on_cuda(torch.float32, 1e-4)])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_replay_runs_cascade_attention_and_equals_naive(arch, device, dtype, tol):
    model = tiny(arch, dtype).to(device)
    assert _Replay(model, ActivationMeter(model), None, None, join_below=0, heads=RAW_LOGPROB).cascade
    rel, calls = replay_vs_naive(model)
    assert rel <= tol
    # Every run after a prefix, in every layer: the two level-1 nodes and the micro-batch of
    # leaves under each. The leaf [30] under the prompt is not run: its one token is scored
    # at the prompt's last position, so nothing of it carries weight.
    runs = 2 + 2
    assert calls == runs * model.config.num_hidden_layers


def test_sliding_window_layers_run_cascade_attention_and_equal_naive():
    """A window shorter than the prompt: the leaves see only the prompt's last keys, through
    masks over the part of it they may see (attention/windows.py)."""
    model = tiny("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert cascade_applies(model)
    rel, calls = replay_vs_naive(model)
    assert rel <= 1e-6 and calls == 4 * model.config.num_hidden_layers


def test_family_without_cascade_falls_back_to_sdpa_and_equals_naive():
    """Llama 4's attention reads positions from its cache, which cascade's does not hold
    (models/families.py): its runs attend to a copy of the prefix in the cache instead."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                           attention_chunk_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.Llama4ForCausalLM(config).double().eval()
    assert not cascade_applies(model)
    rel, calls = replay_vs_naive(model)
    assert rel <= 1e-6 and calls == 0


@pytest.mark.parametrize("dtype, applies", [(torch.float32, True), (torch.float64, True), (torch.bfloat16, True),
                                            (torch.float16, False)])
def test_cascade_applies_to_the_dtypes_of_the_cpu_flash_kernel(dtype, applies):
    assert cascade_applies(tiny("llama", dtype)) is applies


@pytest.mark.parametrize("dtype, head_dim, kernel", [
    (torch.bfloat16, 128, CUDA_FLASH), (torch.float16, 64, CUDA_FLASH), (torch.float32, 64, CUDA_EFFICIENT),
    (torch.float64, 64, None), (torch.bfloat16, 12, None), (torch.bfloat16, 264, None)])
def test_cuda_kernel_choice(dtype, head_dim, kernel):
    """Flash for half precision, memory-efficient for float32 (flash has no float32), none
    for float64 or a head size the kernels do not take: sdpa runs those."""
    assert kernel_for("cuda", dtype, head_dim) is kernel


def test_one_threads_attention_switch_leaves_another_threads_forward_alone():
    """Two rollout shards on one device, or a prefix pass beside a shard, run one model from
    two threads: the attention one switches to (cascade, shared prompt) is its own alone."""
    import threading

    from lsreplay.models.attention_switch import attention_for_thread, model_configs
    from lsreplay.replay.cascade import IMPLEMENTATION

    model = tiny("llama")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        before = model(ids).logits
    entered, release, seen = threading.Event(), threading.Event(), {}

    def switched():
        with attention_for_thread(model_configs(model), IMPLEMENTATION):
            with attention_for_thread([model.config], "eager"):  # nested: the innermost holds
                seen["inner"] = model.config._attn_implementation
            seen["outer"] = model.model.layers[0].self_attn.config._attn_implementation
            entered.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=switched)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        with torch.no_grad():
            during = model(ids).logits  # through cascade attention it would fail: no prefix given
        assert model.config._attn_implementation == "sdpa"
    finally:
        release.set()
        thread.join()
    assert seen == {"inner": "eager", "outer": IMPLEMENTATION}
    assert torch.equal(during, before) and model.config._attn_implementation == "sdpa"
