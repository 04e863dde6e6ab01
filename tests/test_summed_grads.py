"""Every weight's gradient summed in one buffer over many autograd calls
(lsreplay.models.summed_grads) is the gradient autograd sums call by call."""

import pytest
import torch
from conftest import tiny_model

from lsreplay.models.distribution import RAW

from lsreplay.models.summed_grads import summed_in_place
from lsreplay.replay.segments import forward_segments, target_logprobs

# Id 0 is the padding id: nn.Embedding keeps its row's gradient 0.
RUNS = [[1, 5, 9, 3, 7], [2, 2, 8], [0, 4, 6, 1, 0, 3, 9]]


def backward_each(model, runs):
    for tokens in runs:
        hidden, _ = forward_segments(model, [tokens], 0, None)
        target_logprobs(model, hidden[0], list(range(len(tokens) - 1)), tokens[1:], sampling=RAW).sum().backward()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2's q/k/v projections have biases
@pytest.mark.parametrize("tied", [True, False])
def test_summed_in_place_equals_autograd(tied, arch):
    model = tiny_model(arch, vocab=16, tie_word_embeddings=tied, pad_token_id=0)
    embedding = model.get_input_embeddings()
    assert (model.get_output_embeddings().weight is embedding.weight) == tied and embedding.padding_idx == 0
    backward_each(model, RUNS)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    backward_each(model, RUNS[:1])  # a gradient already there is added to
    with summed_in_place(model):
        backward_each(model, RUNS[1:])
        first = expected_first(model, tied, arch)
        for name, p in model.named_parameters():
            if p.dim() == 2:  # the embedding, the head and every linear layer's weight
                assert torch.equal(p.grad, first[name]), f"{name}: held in the buffer until the end"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)
    if not tied:
        assert embedding.weight.grad[0].abs().max() == 0
    assert not embedding._forward_hooks
    assert not [m for m in model.modules() if "forward" in m.__dict__], "the linear layers' own forward is back"


def expected_first(model, tied, arch):
    """Every gradient after RUNS[0] alone, computed again on a copy."""
    copy = tiny_model(arch, vocab=16, tie_word_embeddings=tied, pad_token_id=0)
    copy.load_state_dict(model.state_dict())
    backward_each(copy, RUNS[:1])
    return {name: p.grad for name, p in copy.named_parameters()}


def test_an_interrupted_block_adds_nothing():
    model = tiny_model(vocab=16, pad_token_id=0)
    with pytest.raises(RuntimeError, match="interrupted"):
        with summed_in_place(model):
            backward_each(model, RUNS)
            raise RuntimeError("interrupted")
    assert all(p.grad is None for p in model.parameters() if p.dim() == 2), "the buffers' sums are dropped"
    assert not model.get_input_embeddings()._forward_hooks
    backward_each(model, RUNS[:1])  # and autograd's own path is back
    assert model.get_input_embeddings().weight.grad is not None
