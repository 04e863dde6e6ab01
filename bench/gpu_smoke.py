"""One prepared GPU check: the library's stages on the GPU in bf16, and branch replay against
the per-rollout backward at the production tree shape in bf16 and at a smaller one in float32.

    .venv/bin/python bench/gpu_smoke.py --prepare     # here, once: tokenizer folder + wheels
    .venv/bin/python bench/gpu_smoke.py --smoke       # here: the same code, tiny sizes, CPU
    python3 bench/gpu_smoke.py                        # on one GPU (H200: a few minutes)

The device call (KINDS.md: nvidia-h200; no Prefect, OmegaConf, datasets, reasoning-gym,
boto3, moto, s3fs, gguf there: the wheels of what lsreplay.stages imports travel in .whl/,
and nothing here needs the rest; tests/test_bench_smoke.py runs --smoke with them made
unimportable), with carry [".whl", ".cache/gpu-smoke"] and timeout_s 480:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_smoke.py 2>&1 | tee $OUT/gpu_smoke.log

What it does, each part on its own (a failing part is reported and the next still runs):

1. flow: three RL steps driven through lsreplay.stages in this process, as flows/train.py
   orders them (no Prefect): prompts from a JSONL written here (exact_answer rows: no
   reasoning-gym), rollout trees (step 2's long tail speculative, with step 0's drafter),
   the caching pass, the GRPO update (branch replay over the stored prefix K/V, float32
   masters, a KL penalty to the reference), the drafter. Model: Qwen2.5-0.5B dimensions
   with the SmolLM2 tokenizer's vocabulary, random init (model.arch), model.dtype=bfloat16,
   pool.accelerator=cuda. Checks: every compute stage's manifest names the GPU; the policy
   stays resident on it across steps; the checkpoints of steps 1 and 2 (checkpoint.every=2)
   complete in the background (checkpointing.WRITER.wait()); a process that holds nothing
   loads from the newest checkpoint exactly the masters and bf16 weights that were held;
   the masters moved (rewards of a random model are all 0, so the KL penalty and weight
   decay move them).
2. gradients: replay_backward vs naive_backward on the tree shape of
   configs/h20x8-qwen2.5-7b.yaml (prompt 4096, branching [4, 4] after 512 tokens, 2048-token
   completions) at Qwen2.5-1.5B dimensions, bf16 compute, float32 master gradients
   (TrainState). grad_rel = max |replay - naive| / max |naive| over all tensors; passes at
   <= 3e-2 with cosine >= 0.999 (bf16 rounding; tests/test_mixed_precision.py's bound).
3. speed: the same two backwards timed in alternating order after a warm-up round at full
   shape, --rounds times; replay_speedup = naive s / replay s (fastest round of each).
   Replay computes its branching nodes' K/V itself here (no caching pass given).
4. memory: the device peak of the replay backward (torch.cuda.max_memory_allocated, with
   the state of a training step held: bf16 weights, float32 masters, gradients and AdamW
   moments) next to `lsreplay plan`'s estimate for the same config with
   pool.accelerator=cuda, one device, no FSDP (plan_gib: its total without the reserve
   for the CUDA context and fragmentation, which are not allocations), and the peak the
   backward reports itself (BackwardStats.device_peak_bytes: the manifests' figure).
   Then determinism: the same replay backward twice, bit for bit or not, as a run computes
   (devices.cuda_determinism: flash attention's backward is not deterministic) and with
   pool.deterministic=true (torch.use_deterministic_algorithms; there the sampler's
   fixed-point draws must also pick the float64 draws' tokens).
5. float32: replay_backward vs naive_backward in float32 at Qwen2.5-0.5B dimensions on a
   smaller tree (prompt 1024, branching [4, 4] after 128 tokens, 512-token completions):
   CUDA attends to the prefix with the memory-efficient kernel there (bf16 takes flash);
   passes at grad_rel <= 1e-3 with the cascade path taken.
6. attention variants: replay_backward vs naive_backward in float32 on small Gemma 2 (a
   sliding window shorter than the prompt, attention and final logit softcapping) and GPT-OSS
   (attention sinks, a sliding window, experts) models: on CUDA a masked part of cascade
   attention and a softcapped one run the plain torch kernel (replay/attention/kernels.py);
   passes at grad_rel <= 1e-3 with the cascade path taken.
7. a long prompt layer by layer: Qwen2.5-0.5B dimensions in bf16, a 16384-token prompt and 4
   leaves of 256 tokens, at a budget its graph does not fit (the least the tree runs at, and
   room for a layer over 2048 positions at a time: memory.least_budget), so the prompt runs
   layer by layer (replay/layerwise.py); then the same with replay.offload_prefix (its layer
   inputs in pinned host memory, fetched back a layer ahead on a side stream); then the
   per-rollout backward. Passes where both replay runs took the prompt layer by layer, their
   float32 master gradients agree with the per-rollout ones as part 2's do, and offloading
   lowered the device peak by at least half of the layer inputs it moved (on the CPU: the
   same peak, bit-identical gradients: offload changes nothing there).

The last line: gpu_ok= grad_rel= replay_speedup= peak_gib= plan_gib= f32_grad_rel=
variants_grad_rel= long_grad_rel= offload_saved_gib= (gpu_ok: parts 1, 2, 5, 6 and 7 passed;
peak_gib and offload_saved_gib are nan on the CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# A log, not a terminal: no progress bars. tqdm reads its defaults from the environment when
# it is first imported (torch imports it); datasets has a switch of its own.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from side_by_side import GiB, alternating, gradient_agreement, peak_measured  # noqa: E402
from synthetic import QWEN, qwen_model, random_weights  # noqa: E402

from lsreplay import stages

from lsreplay.core.config import ModelConfig, OptimConfig, load_config  # noqa: E402
from lsreplay.core.devices import cuda_determinism  # noqa: E402
from lsreplay.metrics.records import step_record  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.models.loading import load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from lsreplay.models.train_state import TrainState  # noqa: E402
from lsreplay.planning.plan import make_plan, plan_values  # noqa: E402
from lsreplay.planning.shape import TreeShape  # noqa: E402
from lsreplay.replay import naive_backward, replay_backward  # noqa: E402
from lsreplay.replay.attention.kernels import kernel_for  # noqa: E402
from lsreplay.replay.cascade import cascade_applies  # noqa: E402
from lsreplay.replay.heads import logprob_heads  # noqa: E402
from lsreplay.replay.memory import (ModelDims, layer_run_bytes, layer_workspace_bytes,  # noqa: E402
                                    least_budget)
from lsreplay.replay.view import replay_view  # noqa: E402
from lsreplay.rollout.sampling import draw  # noqa: E402
from lsreplay.stages.prefixes import release_read  # noqa: E402
from lsreplay.stages.preflight import preflight  # noqa: E402
from lsreplay.state import checkpointing  # noqa: E402
from lsreplay.state.resident import RESIDENT  # noqa: E402

PRODUCTION = ROOT / "configs" / "h20x8-qwen2.5-7b.yaml"
TOKENIZER_DIR = ROOT / ".cache" / "gpu-smoke" / "tokenizer"
# What AutoTokenizer.from_pretrained and resolve_model_dir read from a model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
# Imported by lsreplay.stages but not installed on the GPU machine (KINDS.md's package
# list): carried as wheels, at the versions constraints.txt pins.
CARRIED = ("omegaconf", "antlr4-python3-runtime", "datasets", "dill", "multiprocess")
WHEEL_DIR = ROOT / ".whl"
SLOT = [0]  # the pool slot every compute stage holds: cuda:0 (or the CPU)
STEPS = 3
GRAD_REL_MAX, COSINE_MIN = 3e-2, 0.999
# float32 replay vs naive: 1e-4 on the CPU (DESIGN.md); CUDA's kernels sum in other orders.
F32_GRAD_REL_MAX = 1e-3


# -- preparing what the device call carries ---------------------------------------------------
def prepare(tokenizer_dir: Path) -> None:
    """Copy the SmolLM2 tokenizer files into `tokenizer_dir`; download the wheels of CARRIED
    for the GPU machine's Python (3.12, x86-64) into .whl/, emptied first (two versions of
    one package there would stop the install on the device)."""
    source = resolve_model_dir(ModelConfig())
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tokenizer_dir / name)
    pins = dict(line.strip().split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pins = {name.lower(): version for name, version in pins.items()}
    shutil.rmtree(WHEEL_DIR, ignore_errors=True)
    platforms = [f for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for f in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(WHEEL_DIR),
                    *(f"{name}=={pins[name]}" for name in CARRIED)], check=True)
    sizes = sum(f.stat().st_size for d in (tokenizer_dir, WHEEL_DIR) for f in d.iterdir())
    print(f"prepared {tokenizer_dir} and {WHEEL_DIR}: {sizes / 2**20:.1f} MiB to carry")


# -- 1. the flow ------------------------------------------------------------------------------
def write_prompts(path: Path) -> None:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "task": "exact_answer"}
            for a, b in ((3, 4), (12, 30), (7, 8), (25, 17), (9, 9), (40, 2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def flow_config(workdir: Path, tokenizer_dir: Path, smoke: bool):
    """Three steps of two prompts, 2 x 2 rollouts each, on the pool's first device."""
    vocab = len(load_tokenizer(ModelConfig(path=str(tokenizer_dir))))
    dims = {**QWEN["smoke" if smoke else "0.5b"], "vocab_size": vocab}
    config = {
        "run_dir": str(workdir / "run"), "seed": 0, "steps": STEPS, "threads": 1 if smoke else 0,
        "model": {"path": str(tokenizer_dir), "dtype": "bfloat16",
                  "arch": {"model_type": "qwen2", **dims, "max_position_embeddings": 4096, "rope_theta": 1e6}},
        "data": {"path": str(workdir / "prompts.jsonl"), "prompts_per_step": 2},
        "rollout": {"branching": [2, 2], "segment_tokens": [8], "max_new_tokens": 24, "spec_threshold": 8},
        "algo": {"kl_coef": 0.05},
        "optim": {"lr": 1e-3, "weight_decay": 0.1},
        "drafter": {"steps": 2, "batch_size": 4, "checkpoint_every": 1},
        "checkpoint": {"every": 2, "keep_last": 2},
        "pool": {"name": "gpu-smoke", "slots": 1, "accelerator": "cpu" if smoke else "cuda"},
    }
    write_prompts(workdir / "prompts.jsonl")
    path = workdir / "flow.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return load_config(path)


def run_steps(run) -> list[dict]:
    """The stages of every step in flows/train.py's order, in this process. The drafter of
    step t - 1 trains before step t's rollouts (the flow runs it beside them) for all its
    steps, so step 2's rollouts have step 0's drafter for their speculative tail."""
    steps = []
    for step in range(run.cfg.steps):
        m = {"prompts": stages.sample_prompts(run, step)}
        if step > 0:
            steps[-1]["drafter"] = stages.distill_drafter(run, step - 1, devices=SLOT)
            release_read(run, step - 1, "drafter")
        m["trees-shard"] = stages.generate_tree_shard(run, step, 0, devices=SLOT)
        m["trees"] = stages.collect_trees(run, step)
        m["prefixes"] = stages.cache_prefixes(run, step, devices=SLOT)
        m["policy"] = stages.train_policy(run, step, devices=SLOT)
        release_read(run, step, "policy")
        run.append_metrics(step_record(step, m))
        steps.append(m)
    steps[-1]["drafter"] = stages.distill_drafter(run, run.cfg.steps - 1, devices=SLOT)
    release_read(run, run.cfg.steps - 1, "drafter")
    return steps


def flow_checks(run, steps: list[dict], device: torch.device) -> dict[str, bool]:
    where = str(device)
    checks = {
        "stages_on_device": all(m[s]["device"] == where for m in steps
                                for s in ("trees-shard", "prefixes", "policy", "drafter")),
        "drafters_trained": all(m["drafter"]["steps_done"] == run.cfg.drafter.steps for m in steps),
        "speculative_tail": steps[2]["trees"]["spec_rounds"] > 0,  # with step 0's drafter
        "resident": RESIDENT.held(run) == {where: run.cfg.steps},
        # rewards are all 0 (a random model): the KL penalty makes the later steps' gradients
        "gradient_flowed": steps[-1]["policy"]["grad_norm"] > 0,
    }
    checkpointing.WRITER.wait()
    # checkpoint.every=2 of 3 steps: after step 1, and after the last
    checks["checkpoints_complete"] = not checkpointing.WRITER.failed(run) and checkpointing.complete_steps(run) == [1, 2]
    checks |= restart_checks(run, device)
    return checks


def restart_checks(run, device: torch.device) -> dict[str, bool]:
    """What a process holding nothing loads from the newest checkpoint is what was held."""
    held = RESIDENT.train_state(run, run.cfg.steps, device)
    masters = [m.detach().clone() for m in held.masters]
    weights = [p.detach().clone() for p in held.params]
    RESIDENT.release(run)
    del held
    loaded = RESIDENT.train_state(run, run.cfg.steps, device)
    base = load_model(run.cfg.model, dtype="float32")
    return {"restart_masters_equal": all(torch.equal(a, b) for a, b in zip(masters, loaded.masters)),
            "restart_weights_equal": all(torch.equal(a, b) for a, b in zip(weights, loaded.params)),
            "masters_moved": any(not torch.equal(m.cpu(), p) for m, p in zip(masters, base.parameters()))}


def flow(workdir: Path, tokenizer_dir: Path, device: torch.device, smoke: bool) -> dict[str, bool]:
    run = preflight(flow_config(workdir, tokenizer_dir, smoke))
    run.save_or_check_config()
    start = time.perf_counter()
    try:
        steps = run_steps(run)
        for record in run.metrics():
            print(f"  step {record['step']}: reward_mean {record['reward_mean']:.3f} loss {record['loss']:.3g} "
                  f"grad_norm {record['grad_norm']:.3g} kl {record.get('kl', 0):.3g} spec_rounds "
                  f"{record['spec_rounds']} positions_ratio {record['positions_ratio']:.2f}", flush=True)
        checks = flow_checks(run, steps, device)
    finally:
        checkpointing.WRITER.wait()
        RESIDENT.release(run)
    print(f"  flow: {STEPS} steps in {time.perf_counter() - start:.1f} s; "
          + " ".join(f"{k}={str(v).lower()}" for k, v in checks.items()), flush=True)
    return checks


# -- 2-4. replay vs the per-rollout backward at the production tree shape -------------------
def production_config(device: torch.device, smoke: bool):
    """configs/h20x8-qwen2.5-7b.yaml's tree on one device of this kind, no FSDP, no reserve
    (device memory unknown); the smoke run shrinks the lengths, not the branching."""
    shrink = ["data.max_prompt_tokens=64", "rollout.segment_tokens=[32]", "rollout.max_new_tokens=64"] if smoke else []
    return load_config(PRODUCTION, [f"pool.accelerator={device.type}", "pool.slots=1", "pool.devices_per_step=1",
                                    "replay.fsdp=false", "pool.device_memory_gb=0", "data.prompts_per_step=1",
                                    "rollout.shards=1", *shrink])


def backwards(name: str, device: torch.device, rounds: int, smoke: bool) -> dict:
    cfg = production_config(device, smoke)
    r = cfg.rollout
    shape = TreeShape.from_rollout(cfg.data.max_prompt_tokens, r.branching, r.segment_tokens, r.max_new_tokens)
    model = qwen_model(name, device, torch.bfloat16, shape.prompt + shape.completion + 64)
    dims = ModelDims.from_hf(model.config)
    plan = make_plan(cfg, plan_values(cfg), dims, f"Qwen2.5-{name} shape")
    tree, train = shape.random_tree(dims.vocab, seed=1), TrainState(model, cfg.optim)
    weights, budget = random_weights(tree, seed=1), cfg.replay.budget_mb * 2**20 or None
    cuda_determinism(cfg.pool)  # as a run's stages compute (Run.begin)
    last: dict = {}
    print(f"  Qwen2.5-{name} shape: {dims.params() / 1e6:.1f}M params, bf16; tree prompt {shape.prompt}, "
          f"levels {list(shape.levels)}: {tree.total_positions} per-rollout / {tree.unique_positions} unique positions",
          flush=True)

    def replay():
        train.zero_grad()
        last["stats"] = replay_backward(model, [tree], weights, budget_bytes=budget, join_below=cfg.replay.join_below,
                                        heads=logprob_heads(RAW))

    def naive():
        train.zero_grad()
        naive_backward(model, [tree], weights, heads=logprob_heads(RAW))

    replay()
    train.step()  # AdamW's moments now exist: the state a training step holds
    peaks: dict[str, list] = {"replay": [], "naive": []}
    seconds = alternating({k: (lambda k=k, fn=fn: peaks[k].append(peak_measured(device, fn)))
                           for k, fn in (("replay", replay), ("naive", naive))}, rounds, device)
    reported = last["stats"].device_peak_bytes
    replay()
    replay_grads = [m.grad.clone() for m in train.masters]
    naive()
    agreement = gradient_agreement(replay_grads, [m.grad for m in train.masters])
    again = repeatable(replay, train, replay_grads)
    return {"seconds": seconds, "peaks": peaks, "plan": plan, "agreement": agreement, "reported_peak": reported,
            "repeatable": again, "repeatable_strict": strictly_repeatable(replay, train)}


def repeatable(replay, train: TrainState, before: list[torch.Tensor]) -> bool:
    """Whether one more replay backward gives `before`'s master gradients bit for bit."""
    replay()
    return all(torch.equal(a, m.grad) for a, m in zip(before, train.masters))


def strictly_repeatable(replay, train: TrainState) -> bool | str:
    """`repeatable` with every op deterministic (pool.deterministic=true), and the sampler's
    fixed-point draws the float64 ones there; or the error of the first op torch has no
    deterministic kernel for."""
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        replay()
        again = repeatable(replay, train, [m.grad.clone() for m in train.masters])
        return again and sampling_agrees(next(train.model.parameters()).device, train.model.config.vocab_size)
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def sampling_agrees(device: torch.device, vocab: int) -> bool:
    """Whether the sampler's draws as pool.deterministic makes them (rollout.sampling.draw in
    fixed point, on a GPU) pick the tokens of its float64 draws from the same uniforms."""
    probs = torch.randn(48, vocab, device=device, generator=torch.Generator(device).manual_seed(0)).softmax(-1)
    return torch.equal(*(draw(probs, torch.Generator(device).manual_seed(1), exact_sums=e) for e in (True, False)))


def report_backwards(out: dict) -> dict[str, float]:
    s, a, plan = out["seconds"], out["agreement"], out["plan"]
    speedup = min(s["naive"]) / min(s["replay"])
    peak = max(out["peaks"]["replay"]) if out["peaks"]["replay"][0] is not None else math.nan
    naive_peak = max(out["peaks"]["naive"]) if out["peaks"]["naive"][0] is not None else math.nan
    print(f"  gradients: rel {a['rel']:.2e} (<= {GRAD_REL_MAX}), worst tensor {a['worst_tensor']:.2e}, "
          f"cosine {a['cosine']:.6f} (>= {COSINE_MIN})", flush=True)
    print(f"  time per backward, {len(s['replay'])} alternating rounds: replay {' '.join(f'{t:.2f}' for t in s['replay'])} s, "
          f"naive {' '.join(f'{t:.2f}' for t in s['naive'])} s; speedup {speedup:.2f} "
          f"(positions ratio {plan.shape.total_positions / plan.shape.unique_positions:.2f})", flush=True)
    reported = math.nan if out["reported_peak"] is None else out["reported_peak"] / GiB
    print(f"  device peak: replay {peak / GiB:.2f} GiB (plan {plan.peak('replay') / GiB:.2f}; the backward's own "
          f"device_peak_bytes {reported:.2f}), naive {naive_peak / GiB:.2f} GiB (plan {plan.peak('naive') / GiB:.2f}); "
          f"plan's peak run: {plan.replay.what}", flush=True)
    print(f"  determinism: replay twice bit for bit: {out['repeatable']} as a run computes, "
          f"{out['repeatable_strict']} with pool.deterministic=true", flush=True)
    return {"grad_rel": a["rel"], "cosine": a["cosine"], "replay_speedup": speedup, "peak_gib": peak / GiB,
            "plan_gib": plan.peak("replay") / GiB}


# -- 5. float32: the memory-efficient kernel on CUDA ----------------------------------------
def replay_against_naive(model, shape: TreeShape, seed: int) -> dict:
    """gradient_agreement of replay_backward and naive_backward on one random tree of `shape`."""
    tree = shape.random_tree(model.config.vocab_size, seed=seed)
    weights = random_weights(tree, seed=seed)
    replay_backward(model, [tree], weights, heads=logprob_heads(RAW))
    replay_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    naive_backward(model, [tree], weights, heads=logprob_heads(RAW))
    return gradient_agreement(replay_grads, [p.grad for p in model.parameters()])


def float32_backwards(name: str, device: torch.device, smoke: bool) -> dict:
    """replay_backward vs naive_backward of one float32 tree (the smoke run: tiny lengths)."""
    shape = TreeShape.from_rollout(*((64, [4, 4], [16], 48) if smoke else (1024, [4, 4], [128], 512)))
    model = qwen_model(name, device, torch.float32, shape.prompt + shape.completion + 64)
    dims = ModelDims.from_hf(model.config)
    a = replay_against_naive(model, shape, seed=2)
    kernel = kernel_for(device.type, torch.float32, dims.head_dim)
    out = {"grad_rel": a["rel"], "cosine": a["cosine"], "cascade": cascade_applies(model),
           "kernel": kernel.name if kernel else "none"}
    print(f"  Qwen2.5-{name} shape, float32, tree prompt {shape.prompt}, levels {list(shape.levels)}: cascade "
          f"{out['cascade']} ({out['kernel']}); gradients rel {a['rel']:.2e} (<= {F32_GRAD_REL_MAX}), worst tensor "
          f"{a['worst_tensor']:.2e}, cosine {a['cosine']:.8f}", flush=True)
    return out


# -- 6. attention variants ----------------------------------------------------------------------
VARIANT_FAMILIES = {
    "gemma2": dict(sliding_window=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=64),
    "gpt_oss": dict(sliding_window=64, num_local_experts=4, num_experts_per_tok=2),
}


def variant_backwards(device: torch.device, smoke: bool) -> dict:
    """replay_backward vs naive_backward of one float32 tree on each family of VARIANT_FAMILIES."""
    shape = TreeShape.from_rollout(*((48, [2, 2], [8], 24) if smoke else (512, [4, 4], [64], 192)))
    worst = 0.0
    for family, keys in VARIANT_FAMILIES.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(
            family, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **keys)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config).to(device).eval()
        a = replay_against_naive(model, shape, seed=3)
        print(f"  {family} {keys}: cascade {cascade_applies(model)}; gradients rel {a['rel']:.2e}", flush=True)
        if not cascade_applies(model):
            return {"grad_rel": math.inf}
        worst = max(worst, a["rel"])
    return {"grad_rel": worst}


# -- 7. a long prompt layer by layer, its layer inputs on the device or in host memory -------
def long_prompt(name: str, device: torch.device, smoke: bool) -> dict:
    """Replay with the prompt run layer by layer, without and with replay.offload_prefix, and
    the per-rollout backward: float32 master gradients and device peaks."""
    prompt, leaves, suffix, chunk = (256, 4, 16, 32) if smoke else (16384, 4, 256, 2048)
    shape = TreeShape(prompt, ((leaves, suffix),))
    model = qwen_model(name, device, torch.bfloat16, prompt + suffix + 64)
    dims = ModelDims.from_hf(model.config)
    tree = shape.random_tree(dims.vocab, seed=3)
    weights = random_weights(tree, seed=3)
    budget = (least_budget(replay_view(tree, 0), dims, 2)
              + chunk * (layer_run_bytes(dims, 2, 1) + layer_workspace_bytes(dims, 2, 1)))
    train, runs = TrainState(model, OptimConfig()), {}
    for offload in (False, True):
        train.zero_grad()
        stats = {}
        peak = peak_measured(device, lambda: stats.update(out=replay_backward(
            model, [tree], weights, budget_bytes=budget, heads=logprob_heads(RAW), offload_prefix=offload)))
        runs[offload] = (stats["out"], peak, [m.grad.clone() for m in train.masters])
    train.zero_grad()
    naive_peak = peak_measured(device, lambda: naive_backward(model, [tree], weights, heads=logprob_heads(RAW)))
    naive = [m.grad.clone() for m in train.masters]
    (on_device, peak_on, grads_on), (offloaded, peak_off, grads_off) = runs[False], runs[True]
    moved = (dims.layers - 1) * prompt * dims.hidden * 2
    agreement = [gradient_agreement(g, naive) for g in (grads_on, grads_off)]
    out = {"layer_by_layer": on_device.layer_by_layer_positions == offloaded.layer_by_layer_positions == prompt,
           "grad_rel": max(a["rel"] for a in agreement), "cosine": min(a["cosine"] for a in agreement),
           "saved": math.nan if peak_on is None else peak_on - peak_off}
    out["offload_ok"] = (out["saved"] >= moved / 2 if device.type == "cuda" else
                         all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
                         and on_device.peak_activation_bytes == offloaded.peak_activation_bytes)
    print(f"  Qwen2.5-{name} shape, bf16, prompt {prompt} + {leaves} leaves x {suffix}, budget "
          f"{budget / 2**20:.1f} MiB: layer by layer {out['layer_by_layer']}; gradients rel {out['grad_rel']:.2e} "
          f"(<= {GRAD_REL_MAX}), cosine {out['cosine']:.6f}; device peak {_gib(peak_on)} GiB, offloaded {_gib(peak_off)} GiB (layer inputs moved "
          f"{moved / GiB:.2f} GiB), per-rollout {_gib(naive_peak)} GiB; offload ok {out['offload_ok']}", flush=True)
    return out


def _gib(n: int | None) -> str:
    return "nan" if n is None else f"{n / GiB:.2f}"


# -- the run ----------------------------------------------------------------------------------
def part(title: str, fn):
    """fn()'s result, or None with the traceback printed: one part failing leaves the others."""
    print(f"\n== {title}", flush=True)
    try:
        return fn()
    except Exception:
        traceback.print_exc()
        print(f"  {title}: FAILED", flush=True)
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, the same code (well under a minute)")
    ap.add_argument("--prepare", action="store_true", help="copy the tokenizer files and download the wheels to carry")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR, help="a folder with the SmolLM2 tokenizer files")
    ap.add_argument("--model", default="1.5b", choices=("0.5b", "1.5b"), help="model shape for parts 2-4")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of parts 3-4, after one warm-up round")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.tokenizer)
        return 0
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"gpu_smoke: no tokenizer files in {args.tokenizer}; run with --prepare first", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if args.smoke:
        torch.set_num_threads(1)
    where = "CPU" if args.smoke else torch.cuda.get_device_name(device)
    print(f"gpu_smoke on {where}: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, python {sys.version.split()[0]}", flush=True)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as workdir:
        checks = part("1. flow: every stage on the device, bf16", lambda: flow(Path(workdir), args.tokenizer, device,
                                                                               args.smoke))
    out = part("2-4. replay vs per-rollout backward: gradients, time, memory",
               lambda: report_backwards(backwards("smoke" if args.smoke else args.model, device, args.rounds,
                                                  args.smoke)))
    f32 = part("5. float32 replay vs per-rollout backward (CUDA: the memory-efficient kernel)",
               lambda: float32_backwards("smoke" if args.smoke else "0.5b", device, args.smoke))
    variants = part("6. attention variants: windows, softcaps, sinks (CUDA: the plain kernel's masked parts)",
                    lambda: variant_backwards(device, args.smoke))
    long = part("7. a long prompt layer by layer, its layer inputs on the device and in host memory",
                lambda: long_prompt("smoke" if args.smoke else "0.5b", device, args.smoke))
    ok = (checks is not None and all(checks.values()) and out is not None
          and out["grad_rel"] <= GRAD_REL_MAX and out["cosine"] >= COSINE_MIN
          and f32 is not None and f32["cascade"] and f32["grad_rel"] <= F32_GRAD_REL_MAX
          and variants is not None and variants["grad_rel"] <= F32_GRAD_REL_MAX
          and long is not None and long["layer_by_layer"] and long["offload_ok"]
          and long["grad_rel"] <= GRAD_REL_MAX and long["cosine"] >= COSINE_MIN)
    out = out or dict.fromkeys(("grad_rel", "replay_speedup", "peak_gib", "plan_gib"), math.nan)
    print(f"\nwall {time.perf_counter() - wall:.0f} s")
    print(f"gpu_ok={str(ok).lower()} grad_rel={out['grad_rel']:.3e} replay_speedup={out['replay_speedup']:.3f} "
          f"peak_gib={out['peak_gib']:.3g} plan_gib={out['plan_gib']:.3g} "
          f"f32_grad_rel={(f32 or {}).get('grad_rel', math.nan):.3e} "
          f"variants_grad_rel={(variants or {}).get('grad_rel', math.nan):.3e} "
          f"long_grad_rel={(long or {}).get('grad_rel', math.nan):.3e} "
          f"offload_saved_gib={(long or {}).get('saved', math.nan) / GiB:.3g}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
