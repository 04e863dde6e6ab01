"""Each way a family's attention differs (lsreplay/replay/attention/), checked alone in float64:
cascade attention over ancestor parts against one softmax over every key, as the family's
eager attention computes it (scores, softcap, mask, sinks in the normaliser, softmax),
output and every input's gradient; and which keys a layer sees against transformers' own
mask functions."""

import math

import pytest
import torch
from transformers.masking_utils import chunked_overlay, sliding_window_overlay

from lsreplay.replay.attention.kernels import CPU_FLASH, PLAIN, kernel_for
from lsreplay.replay.attention.windows import Visibility, own_mask, part_mask
from lsreplay.replay.cascade import _CascadeAttention, _Plan

ROWS, HEADS, KV_HEADS, WIDTH, DIM = 2, 4, 2, 5, 8
PARTS = (7, 3)  # two ancestors: positions 0..6 and 7..9; the rows' own at 10..14


def inputs(softcap=None, value_dim=DIM):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    own = [rand(ROWS, HEADS, WIDTH, DIM), rand(ROWS, KV_HEADS, WIDTH, DIM), rand(ROWS, KV_HEADS, WIDTH, value_dim)]
    prefix = [rand(1, KV_HEADS, n, d) for n in PARTS for d in (DIM, value_dim)]
    return own, prefix


def eager(query, key, value, prefix, visibility, scale, softcap=None, sinks=None):
    """One softmax over [prefix; own] keys as an eager attention computes it."""
    keys = torch.cat([k.expand(ROWS, -1, -1, -1) for k in prefix[0::2]] + [key], dim=2)
    values = torch.cat([v.expand(ROWS, -1, -1, -1) for v in prefix[1::2]] + [value], dim=2)
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = query @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    start = sum(PARTS)
    seen = visibility.visible(torch.arange(start, start + WIDTH), torch.arange(start + WIDTH))
    scores = scores.masked_fill(~seen, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(ROWS, -1, WIDTH, 1)], dim=-1)
    probs = scores.softmax(-1)[..., : keys.shape[2]]
    return probs @ values


def cascade(query, key, value, prefix, visibility, scale, softcap=None, sinks=None):
    """cascade.cascade_attention's plan for these tensors, through _CascadeAttention."""
    start, offset, parts, tensors = sum(PARTS), 0, [], []
    for k, v in zip(prefix[0::2], prefix[1::2]):
        seen = part_mask(visibility, start, WIDTH, offset, k.shape[2], torch.float64, "cpu")
        offset += k.shape[2]
        if seen is not None:
            parts.append((kernel_for("cpu", torch.float64, DIM, seen[1] is not None, softcap), seen[1]))
            tensors += [k[:, :, seen[0]:], v[:, :, seen[0]:]]
    mask = own_mask(visibility, start, WIDTH, torch.float64, "cpu")
    plan = _Plan(scale, kernel_for("cpu", torch.float64, DIM, mask is not None, softcap), mask, parts)
    return _CascadeAttention.apply(plan, query, key, value, sinks, *tensors)


def assert_same(got, want, leaves):
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_grads = torch.autograd.grad(got, leaves, grad, allow_unused=True)
    want_grads = torch.autograd.grad(want, leaves, grad, allow_unused=True)
    for g, w in zip(got_grads, want_grads):
        if w is None or not w.abs().max():
            assert g is None or not g.abs().max()  # a part no query sees gets no gradient
        else:
            assert (g - w).abs().max() <= 1e-12 * w.abs().max()


@pytest.mark.parametrize("visibility", [Visibility(), Visibility(window=4), Visibility(window=8),
                                        Visibility(chunk=4), Visibility(chunk=12)],
                         ids=["full", "window4", "window8", "chunk4", "chunk12"])
def test_windows_and_chunks(visibility):
    """A window of 4 skips the first ancestor and masks the second; of 8, masks both;
    chunks of 4 see only the own part's chunk, of 12 the second ancestor's last keys too."""
    own, prefix = inputs()
    assert_same(cascade(*own, prefix, visibility, 0.3), eager(*own, prefix, visibility, 0.3), own + prefix)


@pytest.mark.parametrize("visibility", [Visibility(), Visibility(window=6)], ids=["full", "window6"])
def test_softcapped_logits(visibility):
    own, prefix = inputs()
    assert_same(cascade(*own, prefix, visibility, 0.9, softcap=2.0),
                eager(*own, prefix, visibility, 0.9, softcap=2.0), own + prefix)


def test_sinks_join_the_normaliser_and_get_their_gradient():
    own, prefix = inputs()
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    visibility = Visibility(window=6)
    assert_same(cascade(*own, prefix, visibility, 0.3, sinks=sinks),
                eager(*own, prefix, visibility, 0.3, sinks=sinks), own + prefix + [sinks])


def test_plain_kernel_equals_the_cpu_flash_kernel_with_a_mask():
    """The two kernels a masked part may take, on the same masked part: a row that sees no
    key gets a log-sum-exp of -inf from both (the flash kernel's 0 is corrected)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, DIM, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.float64)
    mask[..., 0, :] = -math.inf
    mask[..., 1:, 3:] = -math.inf
    out_flash, lse_flash = CPU_FLASH.forward(q, k, v, False, 0.4, mask)
    out_plain, lse_plain = PLAIN.forward(q, k, v, False, 0.4, mask)
    assert torch.isneginf(lse_flash[..., 0]).all() and torch.isneginf(lse_plain[..., 0]).all()
    assert torch.allclose(out_flash, out_plain, atol=1e-12) and torch.equal(out_plain[..., 0, :], torch.zeros_like(
        out_plain[..., 0, :]))
    assert torch.allclose(lse_flash[..., 1:], lse_plain[..., 1:], atol=1e-12)


@pytest.mark.parametrize("size", [3, 5])
def test_visibility_is_the_families_own_masks(size):
    """Windows and chunks as transformers' mask functions say them, at absolute positions."""
    positions = torch.arange(40)
    window, chunk = sliding_window_overlay(size), chunked_overlay(size, torch.tensor([0]))
    want_window = torch.tensor([[bool(k <= q and window(0, 0, q, k)) for k in range(40)] for q in range(40)])
    want_chunk = torch.tensor([[bool(k <= q and chunk(0, 0, q, k)) for k in range(40)] for q in range(40)])
    assert torch.equal(Visibility(window=size).visible(positions, positions), want_window)
    assert torch.equal(Visibility(chunk=size).visible(positions, positions), want_chunk)
