"""Shared fixtures: a Prefect test server, tiny random models, a tiny model folder."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config,
                          Qwen2ForCausalLM)

from forkrun import without_flow_heartbeats
from s3server import s3_endpoint, store  # noqa: F401  (for every test module: one S3 server, started on first use)

from lsreplay.core import faults
from lsreplay.core.config import ModelConfig
from lsreplay.models.distribution import RAW
from lsreplay.models.loading import resolve_model_dir
from lsreplay.replay.heads import logprob_heads

# What a test scores where the distribution is beside the point (replay's exactness, memory,
# kernels): the policy's own. No scoring function defaults to it; a test names it.
RAW_LOGPROB = logprob_heads(RAW)

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


# Fixtures of the tests that run a vLLM engine or whole flows (a minute or more a file), the
# slower kind first. Every vLLM module asks for vllm_installed (vllm_models.needs_vllm); with
# vllm_model_dir instead, test_vllm_engine (40 s, its own tied model) ran last of all.
LONG_RUNNING = ("vllm_installed", "prefect_server")


def pytest_collection_modifyitems(items):
    """The files of long-running tests first, the vLLM ones first of all. `make test`'s workers
    (pytest-xdist, a file at a time, taken in this order: --no-loadscope-reorder) then end
    together. xdist's own order, most tests first, left the one-test flow files to the end:
    one worker ran 833 s, the other 651 s."""
    rank: dict = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        kind = next((i for i, name in enumerate(LONG_RUNNING) if name in fixtures), len(LONG_RUNNING))
        rank[item.path] = min(rank.get(item.path, kind), kind)
    items.sort(key=lambda item: rank[item.path])


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared CPU the thread pool's waits cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(arch: str = "llama", vocab: int = 64, dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny random Llama or Qwen2 (grouped-query attention; Qwen2 has q/k/v biases)."""
    torch.manual_seed(seed)
    kwargs = {**SIZES, "vocab_size": vocab, **overrides}
    model = LlamaForCausalLM(LlamaConfig(**kwargs)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kwargs))
    return model.to(dtype).eval()


# torch.nn.init's functions as the process started. transformers swaps them while it builds
# a model; two threads building at once can leave them swapped, and every module built
# afterwards is uninitialised (lsreplay.models.loading.building_models). That once made
# test_drafter's distillation fail after the flow tests, far from the cause.
_INIT_FUNCTIONS = {name: getattr(torch.nn.init, name) for name in dir(torch.nn.init) if name.endswith("_")
                   and not name.startswith("_")}


@pytest.fixture(autouse=True)
def torch_init_intact(request):
    """Fail the test after which torch.nn.init is no longer intact (and repair it)."""
    yield
    swapped = [n for n, f in _INIT_FUNCTIONS.items() if getattr(torch.nn.init, n) is not f]
    for name in swapped:
        setattr(torch.nn.init, name, _INIT_FUNCTIONS[name])
    assert not swapped, f"{request.node.nodeid} left torch.nn.init.{swapped[0]} (and {len(swapped) - 1} more) swapped"


@pytest.fixture(autouse=True)
def fresh_faults():
    """Each test's LSREPLAY_FAULTS counts afresh: the fault counters are per process, and an
    earlier test may have used up the same spec (test_spot_drafter's stalls once never fired)."""
    faults.reset()


def _rmsnorm_float64(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """HF's RMSNorm upcasts to float32 only, which is what limits float64 agreement to ~1e-7;
    computed in the model's dtype, replay and naive agree to float64 rounding."""
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rmsnorm_float64)
    monkeypatch.setattr(transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm, "forward", _rmsnorm_float64)


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), without_flow_heartbeats():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer and chat template, saved as an HF folder."""
    out = tmp_path_factory.mktemp("tiny-smollm")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)
    model = tiny_model("llama", vocab=len(tokenizer), dtype=torch.float32, tie_word_embeddings=False,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # A random model never writes a number, so every reward would be 0 and no advantage
    # would move the weights. Give every input embedding a common direction u (it rides the
    # residual stream to the last hidden state) and aim the digit rows of the LM head at u:
    # the model then writes random digits, some of them right.
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    g = torch.Generator().manual_seed(0)
    u = torch.randn(SIZES["hidden_size"], generator=g)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(u)
        head = model.get_output_embeddings().weight
        head.mul_(0.05)
        head[digits] = u + 0.05 * torch.randn(len(digits), len(u), generator=g)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory):
    """A tiny random Llama reward model (sequence classification, one label) with the real
    SmolLM2 tokenizer, saved as an HF folder."""
    out = tmp_path_factory.mktemp("models") / "tiny-rm"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**SIZES, vocab_size=len(tokenizer), num_labels=1,
                                                       pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def record_update_gradients(monkeypatch) -> dict:
    """By parameter name, the gradient each AdamW step takes before it is clipped (filled in
    as the policy updates run)."""
    from lsreplay.models.train_state import TrainState

    seen, clip = {}, TrainState.clip_grad_norm

    def recording(self):
        seen.update({name: m.grad.detach().clone() for name, m in zip(self.names, self.masters)})
        return clip(self)

    monkeypatch.setattr(TrainState, "clip_grad_norm", recording)
    return seen


def assert_same_update(policy: dict, seen: dict, loss: float, grads: dict) -> None:
    """The policy stage's manifest and recorded gradients (`record_update_gradients`) equal a
    reference loss and its gradients, to 1e-9 of each tensor's largest entry."""
    assert policy["positions"] > 0
    assert policy["loss"] == pytest.approx(loss, rel=1e-10, abs=1e-12)
    assert seen.keys() == grads.keys()
    for name, g in grads.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (seen[name] - g).abs().max().item() <= 1e-9 * scale, name


def write_bigram_model(tiny_model_dir, out, added_tokens: list[str], following) -> None:
    """The tiny model with `added_tokens` as a bigram machine, saved to `out`: no attention
    and no MLP (the last token alone decides the next), `following(tokenizer)` mapping each
    token id to the ids that may come next (each with logit 30, so sampling picks among them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer.add_tokens(added_tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        basis = torch.eye(embed.shape[1])
        head.zero_()
        for k, (token, nexts) in enumerate(following(tokenizer).items()):
            # The final RMSNorm makes the residual basis[k] * sqrt(hidden): each next token's logit is 30.
            embed[token] = basis[k]
            head[nexts] += 30 * basis[k] / embed.shape[1] ** 0.5
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
