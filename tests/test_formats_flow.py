"""A TRL user's and a verl user's setup as their docs write it, trained end to end by the real
flow with nothing changed: TRL's standard format (string prompts, a solution column, a
DatasetDict with a test split) with TRL's Example 6 reward (log_extra, log_metric), TRL's
conversational format, and a verl parquet with reward_model.ground_truth and no extra_info.
The prompts' token ids are what TRL's GRPOTrainer renders for the same rows (a Llama-style
tokenizer that adds BOS: tests/trl_rendering.py, checked against TRL itself in
test_trl_parity), and the metrics (TRL's names, what the functions logged) arrive in
metrics.jsonl and in a tracker with the HF trainer's train/ and eval/ keys."""

from __future__ import annotations

import json
import shutil
import statistics

import datasets
import pytest
from transformers import AutoTokenizer

from flowrun import tree_records, unique_pool
from test_formats import verl_rows
from test_reward_styles import TRL_REWARDS
from trl_rendering import save_llama_style_tokenizer, trl_prompt_ids

TRL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "num_tokens", "completions/mean_length",
               "completions/max_terminated_length", "completions/clipped_ratio", "entropy", "learning_rate",
               "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "step_time")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a Llama-style tokenizer: it adds BOS, as TRL tokenizes string prompts."""
    out = tmp_path_factory.mktemp("llama-style-model") / "model"
    shutil.copytree(tiny_model_dir, out)
    save_llama_style_tokenizer(tiny_model_dir, out)
    return out


def overrides(run_dir, model_dir, data, *more) -> list[str]:
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "steps=1", f"data.path={data}",
            "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
            "rollout.max_new_tokens=6", "drafter.enabled=false", "optim.lr=1e-3", unique_pool(), *more]


def trees(run_dir) -> list[dict]:
    return tree_records(run_dir, 0)


def metrics_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_rendered_and_counted(run_dir, model_dir, rows) -> None:
    """Every tree's prompt is TRL's rendering of its row; TRL's figures are in the step's line."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records, line = trees(run_dir), metrics_lines(run_dir)[0]
    for tree in records:
        assert tree["prompt_ids"] == trl_prompt_ids(tokenizer, rows[tree["prompt_index"]]["prompt"])
    for key in TRL_METRICS:
        assert key in line, key
    samples = [(n, r, len(t["prompt_ids"]) + len(c)) for t in records
               for n, r, c in zip(t["counts"], t["rewards"], t["completions"])]
    assert line["num_tokens"] == sum(n * tokens for n, _, tokens in samples)
    assert line["reward_std"] == pytest.approx(statistics.stdev([r for n, r, _ in samples for _ in range(n)]))


def test_trls_standard_format_with_example_6(prefect_server, model_dir, tmp_path, monkeypatch):
    """String prompts go to the model as they are (BOS first); Example 6's log_metric reaches
    metrics.jsonl and TensorBoard (train/accuracy), its log_extra columns trees.json; the
    held-out prompts are the DatasetDict's test split (TRL's dataset_test_split)."""
    from flows.train import train
    from test_trackers import tensorboard_scalars

    (tmp_path / "trl_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"Problem: Solve the equation $x - {i} = {i}$. Solution:", "solution": f"x = {2 * i}",
             "ground_truth": str(2 * i)} for i in range(10)]
    data = tmp_path / "trl-dataset"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:])}).save_to_disk(str(data))
    run_dir = tmp_path / "run"
    train(overrides=overrides(run_dir, model_dir, data, "reward.functions=[trl_rewards_15.logging_reward_func,"
                              "trl_rewards_15.reward_func]", "reward.weights=[1,0.01]", "eval.every=1",
                              "eval.split=test", "eval.size=2", "eval.samples=2", "report_to=tensorboard"))
    check_rendered_and_counted(run_dir, model_dir, rows)
    records, lines = trees(run_dir), metrics_lines(run_dir)
    # One shard, one call: log_metric("accuracy", sum(rewards) / len(rewards)) of its batch.
    assert lines[0]["accuracy"] == pytest.approx(
        statistics.fmean(r for t in records for r in t["reward_functions"]["logging_reward_func"]))
    for tree in records:
        assert tree["extras"]["golden_answer"] == [rows[tree["prompt_index"]]["ground_truth"]] * len(tree["texts"])
        assert tree["reward_functions"]["reward_func"] == [float(len(t)) for t in tree["texts"]]
    evaluated = json.loads((run_dir / "step_0001/eval.json").read_text())["answers"]
    assert sorted(a["question"] for a in evaluated) == [rows[8]["prompt"], rows[9]["prompt"]]
    assert {"eval_accuracy", "eval_reward"} <= lines[0].keys() | lines[1].keys()
    assert tensorboard_scalars(run_dir / "tracking/tensorboard", "train/accuracy") == [
        (0, round(lines[0]["accuracy"], 6))]
    assert [s for s, _ in tensorboard_scalars(run_dir / "tracking/tensorboard", "eval/accuracy")] == [0, 1]


def test_trls_conversational_format(prefect_server, model_dir, tmp_path, monkeypatch):
    """Messages through the chat template with the generation prompt; completions reach the
    functions as assistant messages."""
    from flows.train import train

    (tmp_path / "chat_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 2?"}], "solution": str(2 * i)} for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    train(overrides=overrides(run_dir, model_dir, data, "reward.functions=[chat_rewards_15.format_reward_func,"
                              "chat_rewards_15.async_reward_func]"))
    check_rendered_and_counted(run_dir, model_dir, rows)
    (line,) = metrics_lines(run_dir)
    assert line["rewards/format_reward_func/mean"] == 0.0  # no <think> from a random model
    for tree in trees(run_dir):
        assert tree["reward_functions"]["async_reward_func"] == [float(bool(t)) for t in tree["texts"]]


def test_a_verl_parquet_without_extra_info(prefect_server, model_dir, tmp_path, monkeypatch):
    """verl's compute_score gets reward_model.ground_truth (over an answer column), extra_info
    {} with num_turns where the rows have none, and its dict's other keys are logged."""
    from flows.train import train

    (tmp_path / "verl_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    rows = [{**{k: v for k, v in row.items() if k != "extra_info"}, "answer": "not the ground truth"}
            for row in verl_rows(8)]
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    run_dir = tmp_path / "run"
    train(overrides=overrides(run_dir, model_dir, data, "reward.functions=[verl_rewards_15.py:my_reward_fn,"
                              "verl_rewards_15.py:verl_seen]", "reward.kwargs=[{},{bonus: 0.25}]",
                              "report_to=[tensorboard]"))
    check_rendered_and_counted(run_dir, model_dir, rows)
    (line,) = metrics_lines(run_dir)
    for tree in trees(run_dir):
        truth = rows[tree["prompt_index"]]["reward_model"]["ground_truth"]
        assert tree["reward_functions"]["verl_seen"] == [float(t == truth) + 0.25 for t in tree["texts"]]
        assert tree["extras"]["turns"] == [2] * len(tree["texts"]) and set(tree["extras"]["split"]) == {"none"}
    assert line["extras/turns/mean"] == 2 and line["rewards/my_reward_fn/mean"] > 0
