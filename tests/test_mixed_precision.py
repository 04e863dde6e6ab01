"""Mixed precision: bf16 compute over float32 master weights, gradients and AdamW moments.

An AdamW update of lr 1e-6 is far below half a bf16 ulp of a weight: applied to bf16
parameters most of it vanishes. With float32 masters a bf16 run moves the weights as a
float32 run does, and replay's many backward calls accumulate in float32.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import RAW_LOGPROB, tiny_model
from safetensors.torch import load_file

from lsreplay import stages

from lsreplay.core.config import OptimConfig, load_config
from lsreplay.core.run import Run
from lsreplay.models.train_state import TrainState
from lsreplay.replay import naive_backward, replay_backward
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT
from lsreplay.tree import RolloutTree


def config(run_dir, model_dir, dtype: str):
    return load_config(None, [f"run_dir={run_dir}", f"model.path={model_dir}", f"model.dtype={dtype}", "steps=1",
                              "data.size=8", "data.prompts_per_step=2", "rollout.branching=[2,2]",
                              "rollout.segment_tokens=[3]", "rollout.max_new_tokens=6", "optim.lr=1e-6",
                              "drafter.enabled=false", "reward.function=varied_rewards:code_parity"])


@pytest.fixture(scope="module")
def trees_dir(tiny_model_dir, tmp_path_factory):
    """Step 0's prompts and trees, sampled once by the float32 policy."""
    run_dir = tmp_path_factory.mktemp("mixed") / "trees"
    run = Run(config(run_dir, tiny_model_dir, "float32"))
    run.save_or_check_config()
    stages.sample_prompts(run, 0)
    stages.generate_trees(run, 0)
    RESIDENT.release(run)
    return run_dir


def update_on_same_trees(trees_dir, model_dir, dest, dtype: str) -> tuple[dict, dict]:
    """The caching pass and policy update of step 0 on the shared trees, in `dtype`:
    (checkpointed master weights, the compute weights the process holds after the update)."""
    shutil.copytree(trees_dir, dest)
    run = Run(config(dest, model_dir, dtype))
    stages.cache_prefixes(run, 0)
    manifest = stages.train_policy(run, 0)
    checkpointing.WRITER.wait()
    compute = {n: p.detach().clone() for n, p in RESIDENT.policy(run, 1, torch.device("cpu")).named_parameters()}
    RESIDENT.release(run)
    return load_file(str(dest / manifest["checkpoint"] / "model.safetensors")), compute


def test_bf16_run_moves_the_weights_as_the_float32_run_does(trees_dir, tiny_model_dir, tmp_path):
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    fp32, _ = update_on_same_trees(trees_dir, tiny_model_dir, tmp_path / "fp32", "float32")
    bf16, compute = update_on_same_trees(trees_dir, tiny_model_dir, tmp_path / "bf16", "bfloat16")
    assert all(t.dtype == torch.float32 for t in bf16.values())  # the checkpoint holds the masters
    d32 = torch.cat([(fp32[n] - base[n]).flatten() for n in base])
    d16 = torch.cat([(bf16[n] - base[n]).flatten() for n in base])
    # The same update to bf16 tolerance, in direction and size. (AdamW's first step is
    # about lr * sign(g): where |g| is within bf16 noise of 0, the two runs' signs differ.)
    cosine = float(d16 @ d32 / (d16.norm() * d32.norm()))
    assert cosine > 0.95, cosine
    assert 0.95 < float(d16.norm() / d32.norm()) < 1.05, float(d16.norm() / d32.norm())
    assert float((d16 != 0).float().mean()) > 0.95 * float((d32 != 0).float().mean())
    # What bf16 parameters alone would have kept of it: almost nothing.
    kept = torch.cat([(compute[n].float() != base[n].to(torch.bfloat16).float()).flatten() for n in base])
    assert float(kept.float().mean()) < 0.05
    # The compute weights are the masters rounded.
    assert all(torch.equal(compute[n], bf16[n].to(torch.bfloat16)) for n in base)


def trees_batch(vocab: int) -> tuple[list[RolloutTree], list]:
    g = torch.Generator().manual_seed(3)
    trees, weights = [], []
    for prompt_len in (40, 24):
        prompt = torch.randint(vocab, (prompt_len,), generator=g).tolist()
        stems = [torch.randint(vocab, (5,), generator=g).tolist() for _ in range(2)]
        completions = [s + torch.randint(vocab, (n,), generator=g).tolist() for s in stems for n in (4, 9)]
        trees.append(RolloutTree.from_sequences(prompt, completions))
        weights.append([torch.randn(len(c), generator=g, dtype=torch.float64) for c in completions])
    return trees, weights


def master_grads(model, trees, weights, backward, **kwargs) -> torch.Tensor:
    train = TrainState(model, OptimConfig())
    train.zero_grad()
    backward(model, trees, weights, heads=RAW_LOGPROB, **kwargs)
    assert all(p.grad is None for p in train.params)  # each call's bf16 gradient went to its master
    assert all(m.grad.dtype == torch.float32 for m in train.masters)
    return torch.cat([m.grad.flatten() for m in train.masters])


def test_replay_and_per_rollout_gradients_agree_in_bf16_compute():
    trees, weights = trees_batch(vocab=64)
    reference = tiny_model(dtype=torch.float64)
    naive_backward(reference, trees, weights, heads=RAW_LOGPROB)
    exact = torch.cat([p.grad.flatten() for p in reference.parameters()]).float()
    replay = master_grads(tiny_model(dtype=torch.bfloat16), trees, weights, replay_backward)
    naive = master_grads(tiny_model(dtype=torch.bfloat16), trees, weights, naive_backward)
    scale = exact.abs().max()
    # Both bf16 paths sit within bf16 rounding of the exact gradient, and of each other.
    assert float((replay - exact).abs().max() / scale) < 3e-2
    assert float((naive - exact).abs().max() / scale) < 3e-2
    assert float((replay - naive).abs().max() / scale) < 3e-2
    assert float(replay @ exact / (replay.norm() * exact.norm())) > 0.999


def test_float_logits_of_a_bf16_head_are_float32_and_keep_no_float32_copy_of_it():
    from lsreplay.models.logits import CHUNK, float_logits
    from lsreplay.replay.memory import ActivationMeter

    model = tiny_model(vocab=CHUNK * 2 + 100, dtype=torch.bfloat16)  # three vocabulary chunks
    head = model.get_output_embeddings().weight
    hidden = torch.randn(5, head.shape[1], dtype=torch.bfloat16, requires_grad=True)
    meter = ActivationMeter(model)
    with meter.measure():
        logits = float_logits(model, hidden)
        saved = meter.current
    assert saved < head.numel()  # the bf16 input row only: no float32 head (4 bytes per weight)
    with torch.no_grad():
        exact = hidden.double() @ head.double().T
        assert logits.dtype == torch.float32
        assert float((logits - exact).abs().max()) < 1e-5 * float(exact.abs().max())
    grad = torch.randn_like(logits)
    logits.backward(grad)
    assert hidden.grad.dtype == head.grad.dtype == torch.bfloat16
    assert torch.allclose(head.grad.double(), grad.double().T @ hidden.double(), rtol=1e-2, atol=1e-3)
    assert torch.allclose(hidden.grad.double(), grad.double() @ head.double(), rtol=1e-2, atol=1e-3)


def _loss(model) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 64
    return model(input_ids=ids).logits.float().logsumexp(-1).mean()


def test_a_second_state_over_one_bf16_model_takes_its_gradients_and_frees_the_first():
    """A resident copy's model is reused under a new TrainState: one hook per parameter,
    rerouted, so the gradients go into the new masters (two hooks failed: the first set
    param.grad to None, the second read it), and the superseded state's float32 masters
    are not kept alive by the model they were built over."""
    import gc
    import weakref

    model = tiny_model(dtype=torch.bfloat16)
    first = TrainState(model, OptimConfig())
    gone = weakref.ref(first.masters[0])
    second = TrainState(model, OptimConfig())
    _loss(model).backward()
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in second.masters)
    assert all(m.grad is None for m in first.masters) and all(p.grad is None for p in model.parameters())
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
    del first
    gc.collect()
    assert gone() is None


def test_a_state_moved_to_another_copy_and_back_accumulates_into_the_newest_masters():
    """RESIDENT.train_state moves a state to the device that runs the update and later back
    to a model that already carried one (the thread runner's handoff makes it timing-
    dependent on a GPU pool). On the CPU the two "devices" are two copies of one model: the
    gradients of a backward after the round trip are those of a fresh state, in float32,
    and the states left behind (with their masters and gradients) are freed."""
    import copy
    import gc
    import weakref

    here = tiny_model(dtype=torch.bfloat16)
    there = copy.deepcopy(here)
    start = TrainState(here, OptimConfig())
    _loss(here).backward()
    start.step()
    left_behind = weakref.ref(start.masters[0])
    moved = start.moved_to(there)
    back = moved.moved_to(here)
    del start, moved
    gc.collect()
    assert left_behind() is None
    back.zero_grad()
    _loss(here).backward()
    fresh = TrainState(copy.deepcopy(here), OptimConfig())
    _loss(fresh.model).backward()
    for mine, expected in zip(back.masters, fresh.masters):
        assert mine.grad.dtype == torch.float32 and torch.equal(mine.grad, expected.grad)


def test_a_bf16_policy_computes_what_from_pretrained_in_bf16_does(tiny_model_dir):
    """load_model casts to bf16 as from_pretrained(dtype=bf16) builds the model: the rotary
    inverse frequencies stay float32 (cast with the weights, they are off by up to 0.4%,
    which a long prompt turns into different logits); a random model of model.arch too."""
    from transformers import AutoModelForCausalLM

    from lsreplay.core.config import ModelConfig
    from lsreplay.models.loading import load_model

    cfg = ModelConfig(path=str(tiny_model_dir), dtype="bfloat16")
    ours = load_model(cfg, trainable=False)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, local_files_only=True,
                                                  attn_implementation=cfg.attn_implementation).eval()
    ids = torch.randint(ours.config.vocab_size, (1, 1800), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
    assert {t.dtype for n, t in ours.named_buffers() if "inv_freq" in n} == {torch.float32}
    arch = ModelConfig(dtype="bfloat16", arch={"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                               "num_hidden_layers": 1, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "vocab_size": 100})
    random = load_model(arch)
    assert next(random.parameters()).dtype == torch.bfloat16
    assert {t.dtype for n, t in random.named_buffers() if "inv_freq" in n} == {torch.float32}


def test_a_bf16_runs_drafter_checkpoints_float32_masters_and_resumes_from_them(tiny_model_dir, tmp_path):
    """The drafter of a bf16 policy computes in bf16 and trains float32 masters: its spot
    checkpoint holds the masters (a resumed or warm-started drafter continues from them, not
    from their bf16 rounding), its export the bf16 weights it computes with."""
    from lsreplay.stages.common import policy_before
    from lsreplay.stages.drafter import _start_or_resume

    run = Run(load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "model.dtype=bfloat16",
                                 "steps=1", "data.size=8", "data.prompts_per_step=2", "rollout.branching=[2,2]",
                                 "rollout.segment_tokens=[3]", "rollout.max_new_tokens=6", "drafter.steps=3",
                                 "drafter.checkpoint_every=3", "drafter.batch_size=2"]))
    run.save_or_check_config()
    stages.sample_prompts(run, 0)
    stages.generate_trees(run, 0)
    stages.cache_prefixes(run, 0)
    stages.train_policy(run, 0)  # the drafter of step 0 drafts for the policy after it
    done = stages.distill_drafter(run, 0)
    saved = load_file(str(tmp_path / done["checkpoint"] / "model.safetensors"))
    exported = load_file(str(tmp_path / done["checkpoint"] / "hf" / "model.safetensors"))
    assert done["steps_done"] == 3
    assert {t.dtype for t in saved.values()} == {torch.float32} and {t.dtype for t in exported.values()} == {
        torch.bfloat16}
    checkpointing.WRITER.wait()
    resumed = _start_or_resume(run, 0, policy_before(run, 1, torch.device("cpu")))
    RESIDENT.release(run)
    assert resumed.steps_done == 3
    assert all(torch.equal(m, saved[n]) for n, m in zip(resumed.train.names, resumed.train.masters))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in resumed.train.masters)  # more than bf16 holds
