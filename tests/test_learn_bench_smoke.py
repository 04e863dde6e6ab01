"""bench/learn.py end to end (--smoke): a flow run per algorithm, under the session's Prefect
server. Apart from tests/test_bench_smoke.py's (which need none): the two files then fill two
test workers more evenly."""

from flowrun import run_bench, unique_pool


def test_learn_bench_smoke(prefect_server, tiny_model_dir, tmp_path):
    """bench/learn.py --smoke with every run: GRPO through replay and per rollout, PPO with a
    critic, online DPO, LoRA; each flow run evaluates before and after its update, the curves
    are drawn, the costs' line carries each run's step time, activation peak and model state
    (LoRA's far below full training's), the algorithms' line each one's accuracy before and
    after, and the last line the four figures of replay against the baseline."""
    plot = tmp_path / "learn.png"
    proc = run_bench("learn", ["--smoke", "--out", str(tmp_path / "runs"), "--runs", "replay,baseline,ppo,dpo,lora",
                               "--plot", str(plot), f"model.path={tiny_model_dir}", unique_pool()], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    pairs = dict(item.split("=", 1) for item in lines[-1].split())
    assert list(pairs) == ["acc_start", "acc_end", "baseline_acc_end", "wall_ratio"]
    assert all(0 <= float(pairs[k]) <= 1 for k in ("acc_start", "acc_end", "baseline_acc_end"))
    assert float(pairs["wall_ratio"]) > 0
    assert sum("held-out accuracy" in line for line in lines) == 10  # five runs, before and after the update
    algos = dict(item.split("=", 1) for item in lines[-3].split())
    runs = ("replay", "baseline", "ppo", "dpo", "lora")
    assert list(algos) == [f"{run}_acc_{when}" for run in runs for when in ("start", "end")]
    assert all(0 <= float(v) <= 1 for v in algos.values())
    assert len({algos[f"{run}_acc_start"] for run in ("replay", "ppo", "dpo", "lora")}) == 1  # the same start and set
    cost = dict(item.split("=", 1) for item in lines[-4].split())
    assert list(cost) == [f"{run}_{k}" for run in runs for k in ("step_s", "activation_peak_mib", "state_mib")]
    assert all(float(cost[f"{run}_step_s"]) > 0 for run in runs)
    assert float(cost["lora_state_mib"]) < float(cost["replay_state_mib"]) / 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "runs/report/curves.png").is_file()
