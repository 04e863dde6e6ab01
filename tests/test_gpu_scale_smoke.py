"""bench/gpu_scale.py --smoke: the GPU scale benchmark's code path on a tiny Qwen2 shape on
CPU (out-of-memory simulated by a cap on the activation meter)."""

from flowrun import run_bench


def test_gpu_scale_smoke(tmp_path):
    proc = run_bench("gpu_scale", ["--smoke", "--threads", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kv = dict(item.split("=", 1) for item in proc.stdout.strip().splitlines()[-1].split())
    assert float(kv["speedup_smoke"]) > 0 and float(kv["ideal_smoke"]) == 3.0  # G=4, P=48, S=6
    assert float(kv["replay_tok_s_smoke"]) > 0 and float(kv["naive_tok_s_smoke"]) > 0
    # replay and naive gradients agree to bf16 rounding (tests/test_mixed_precision.py's bound)
    assert float(kv["grad_rel_smoke"]) < 3e-2 and float(kv["grad_cosine_smoke"]) > 0.999
    # the largest-tree search found a bound for both (the simulated cap) and a tree that trained
    assert kv["max_bounded_smoke"] == "true"
    assert int(kv["max_positions_replay_smoke"]) > 0 and int(kv["max_positions_naive_smoke"]) > 0
    assert float(kv["wall_s"]) < 60
