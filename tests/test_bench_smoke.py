"""The benchmarks run end to end (--smoke) and end with their key=value summary line."""

import math
import subprocess
import sys
from pathlib import Path

from flowrun import run_bench

from lsreplay.replay.memory import RUN_POSITIONS

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("speedup", "ideal", "efficiency", "mem_ratio")
# What the GPU machine lacks and bench/gpu_smoke.py does not carry (the device tool's KINDS.md).
NOT_ON_THE_GPU_MACHINE = ("reasoning_gym", "boto3", "botocore", "moto", "prefect", "s3fs", "gguf")


def as_on_the_gpu_machine(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `python3 SCRIPT ARGS` (or `python3 -m MODULE ARGS`) in ROOT as it runs there: with
    every module of NOT_ON_THE_GPU_MACHINE unimportable."""
    if argv[0] == "-m":
        run, argv = f"runpy.run_module({argv[1]!r}, run_name='__main__', alter_sys=True)", argv[1:]
    else:
        run = f"sys.path.insert(0, {str((ROOT / argv[0]).parent)!r}); runpy.run_path({argv[0]!r}, run_name='__main__')"
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({NOT_ON_THE_GPU_MACHINE!r})); "
            f"sys.argv = {list(argv)!r}; {run}")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_cascade_tests_run_where_neither_boto3_nor_moto_is():
    """docs/gpu.md's command, `pytest tests/test_cascade.py -k cuda`, collects and runs
    on a machine without the S3 test server's packages (here its CUDA cases skip)."""
    proc = as_on_the_gpu_machine("-m", "pytest", "tests/test_cascade.py", "-q", "-k", "cuda", "-p", "no:cacheprovider")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert " passed" in proc.stdout and "error" not in proc.stdout.lower()


def test_replay_bench_smoke(tmp_path):
    proc = run_bench("replay", ["--smoke"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, proc.stderr[-4000:]
    pairs = dict(item.split("=", 1) for item in lines[-1].split())
    for key in REQUIRED:
        assert key in pairs, f"{key}= missing from the last line: {lines[-1]!r}"
        assert math.isfinite(float(pairs[key])) and float(pairs[key]) > 0, (key, pairs[key])
    # Per-shape values come with the headline, and the gradients agree (float32).
    shapes = [k.removeprefix("speedup_") for k in pairs if k.startswith("speedup_")]
    assert shapes
    for shape in shapes:
        for key in REQUIRED:
            assert math.isfinite(float(pairs[f"{key}_{shape}"]))
    assert float(pairs["efficiency"]) == min(float(pairs[f"efficiency_{s}"]) for s in shapes)
    assert float(pairs["mem_ratio"]) == max(float(pairs[f"mem_ratio_{s}"]) for s in shapes)
    assert float(pairs["grad_rel_diff"]) <= 1e-4


def test_long_context_bench_smoke(tmp_path):
    """bench/long_context.py --smoke: replay against the per-rollout backward as the prompt
    grows; the longest runs layer by layer, replay's peak stays within its bound and at or
    below the per-rollout peak, and per prompt position it shrinks as the prompt grows."""
    proc = run_bench("long_context", ["--smoke"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    kv = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert kv["within_bound"] == kv["below_naive"] == "true"
    assert {"time_ratio_128", "time_ratio_256", "naive_peak_mib_256", "replay_peak_mib_512"} <= kv.keys()
    assert "time_ratio_512" not in kv  # replay alone at the longest
    per_position = [float(kv[f"replay_bytes_per_position_{p}"]) for p in (128, 256, 512)]
    assert per_position == sorted(per_position, reverse=True)
    assert "512 positions layer by layer" in proc.stdout


def test_shared_prompt_bench_smoke(tmp_path):
    """bench/shared_prompt.py --smoke: both rollout layouts on a kv_retrieval prompt, the K/V
    each held, the same leaves."""
    proc = run_bench("shared_prompt", ["--smoke"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pairs = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert float(pairs["kv_ratio"]) == float(pairs["kv_ratio_256"]) > 4  # G=8 rows of a 256-token prompt
    assert float(pairs["kv_shared_mib_256"]) < float(pairs["kv_repeated_mib_256"])
    assert math.isfinite(float(pairs["stage_speedup_256"])) and float(pairs["same_leaves_256"]) > 0


def test_run_cost_bench_smoke(tiny_model_dir, tmp_path):
    """bench/run_cost.py times runs of each length and fits their fixed cost, next to the
    constant the replay planner uses."""
    proc = run_bench("run_cost", ["--lengths", "4,8,16", "--rounds", "1", f"model.path={tiny_model_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("run of L positions (s): L=4 ")
    pairs = dict(item.split("=", 1) for item in lines[-1].split())
    assert list(pairs) == ["fixed_seconds", "per_position_ms", "fixed_positions", "run_positions", "threads"]
    assert all(math.isfinite(float(v)) for v in pairs.values())
    assert int(pairs["run_positions"]) == RUN_POSITIONS


def test_dpo_bench_smoke(tmp_path):
    """bench/dpo.py --smoke: offline DPO through replay and per pair, the same loss and gradient."""
    proc = run_bench("dpo", ["--smoke"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pairs = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert float(pairs["speedup"]) > 0 and float(pairs["ideal"]) > 1 and float(pairs["mem_ratio"]) < 1
    assert float(pairs["grad_rel_diff"]) <= 1e-4 and float(pairs["loss_gap"]) <= 1e-6


def test_rollout_bench_smoke(tmp_path):
    """bench/rollout.py --smoke: plain and adaptive stages run and the summary line has the ratio."""
    proc = run_bench("rollout", ["--smoke"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pairs = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert float(pairs["stage_speedup"]) > 0 and float(pairs["accept_len"]) >= 1 and int(pairs["spec_rounds"]) > 0


def test_gpu_smoke_on_cpu():
    """bench/gpu_smoke.py --smoke, as on the GPU machine (reasoning-gym, boto3, moto, Prefect,
    s3fs, gguf unimportable): the GPU check's code with tiny sizes on the CPU, the real
    SmolLM2 tokenizer: every stage ran where the pool put it, the resident policy and the
    checkpoints held up, replay and naive gradients agree in bf16 and in float32 (the
    cascade path taken, also with windows, softcaps and sinks), the plan has an estimate, a
    long prompt ran layer by layer."""
    from lsreplay.core.config import ModelConfig
    from lsreplay.models.loading import resolve_model_dir

    tokenizer = resolve_model_dir(ModelConfig())
    proc = as_on_the_gpu_machine("bench/gpu_smoke.py", "--smoke", "--tokenizer", str(tokenizer))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    kv = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert list(kv) == ["gpu_ok", "grad_rel", "replay_speedup", "peak_gib", "plan_gib", "f32_grad_rel",
                        "variants_grad_rel", "long_grad_rel", "offload_saved_gib"]
    assert kv["gpu_ok"] == "true" and float(kv["grad_rel"]) <= 3e-2 and float(kv["f32_grad_rel"]) <= 1e-4
    assert float(kv["variants_grad_rel"]) <= 1e-4
    assert "cascade True (cpu-flash)" in proc.stdout
    assert "bit for bit: True as a run computes, True with pool.deterministic=true" in proc.stdout
    assert float(kv["replay_speedup"]) > 0 and float(kv["plan_gib"]) > 0
    assert math.isnan(float(kv["peak_gib"]))  # no allocator peak on the CPU
    # The long prompt ran layer by layer, offloaded or not (on the CPU: the same, bit for bit).
    assert float(kv["long_grad_rel"]) <= 3e-2 and "layer by layer True" in proc.stdout
    assert "offload ok True" in proc.stdout and math.isnan(float(kv["offload_saved_gib"]))
    flow = next(line for line in proc.stdout.splitlines() if line.strip().startswith("flow:"))
    assert "=false" not in flow and "stages_on_device=true" in flow and "restart_weights_equal=true" in flow
