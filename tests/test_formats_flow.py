"""A TRL user's and a verl user's setup as it is, trained end to end by the real flow: a
verl parquet with compute_score, a TRL dataset (save_to_disk, and jsonl of chat messages)
with TRL's reward functions; nothing added to the prompts, TRL's metric names logged, and
a tracker reading the lines back."""

from __future__ import annotations

import json

import datasets
from transformers import AutoTokenizer

from flowrun import tree_records, unique_pool
from test_formats import verl_rows
from test_reward_styles import TRL_REWARDS

NOTHING_ADDED = ["data.system_prompt=", "data.answer_instruction="]


def overrides(run_dir, model_dir, data, *more) -> list[str]:
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "steps=1", f"data.path={data}",
            "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
            "rollout.max_new_tokens=6", "drafter.enabled=false", "optim.lr=1e-3", unique_pool(), *NOTHING_ADDED,
            *more]


def trees(run_dir) -> list[dict]:
    return tree_records(run_dir, 0)


def test_a_verl_parquet_with_its_reward_functions(prefect_server, tiny_model_dir, tmp_path, monkeypatch):
    from flows.train import train
    from test_trackers import tensorboard_scalars

    (tmp_path / "verl_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl_rows(8)).to_parquet(str(data))
    run_dir = tmp_path / "run"
    metrics = train(overrides=overrides(run_dir, tiny_model_dir, data, "reward.functions=[verl_rewards_15.py:"
                                        "my_reward_fn,verl_rewards_15.py:compute_score]", "report_to=[tensorboard]"))
    m = metrics[0]
    assert m["reward"] == m["reward_mean"] and m["rewards/my_reward_fn/mean"] == m["reward"] > 0
    assert m["rewards/compute_score/mean"] == 0  # no "#### 2i" from a random model
    for key in ("reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_terminated_length",
                "completions/clipped_ratio", "entropy", "learning_rate", "clip_ratio/region_mean", "step_time",
                "rollout_tokens_per_s", "prefixes_positions_per_s", "train_positions_per_s"):
        assert key in m, key
    assert m["learning_rate"] == 1e-3 and m["clip_ratio/region_mean"] == 0  # one update per batch: ratio 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    rows = verl_rows(8)
    for tree in trees(run_dir):  # the messages in the chat template, nothing added
        text = tokenizer.apply_chat_template(rows[tree["prompt_index"]]["prompt"], add_generation_prompt=True,
                                             tokenize=False)
        assert tree["prompt_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tree["rewards"] == [len(t) / 100 for t in tree["texts"]]
    assert tensorboard_scalars(run_dir / "tracking/tensorboard", "reward") == [(0, round(m["reward"], 6))]


def test_a_trl_dataset_saved_to_disk_with_held_out_evaluation(prefect_server, tiny_model_dir, tmp_path, monkeypatch):
    """TRL's standard format: string prompts go to the model as they are."""
    from flows.train import train

    (tmp_path / "trl_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{i} + {i} =", "ground_truth": str(2 * i), "task": "math"} for i in range(10)]
    data = tmp_path / "trl-dataset"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(data))
    run_dir = tmp_path / "run"
    metrics = train(overrides=overrides(run_dir, tiny_model_dir, data, "data.chat_template=false",
                                        "reward.functions=[trl_rewards_15.reward_func,trl_rewards_15.accuracy_func]",
                                        "reward.weights=[0.1,1]", "eval.every=1", "eval.size=2", "eval.samples=2"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    for tree in trees(run_dir):
        assert tree["prompt_ids"] == tokenizer(rows[tree["prompt_index"]]["prompt"], add_special_tokens=False)[
            "input_ids"]
        assert tree["reward_functions"]["reward_func"] == [float(len(t)) for t in tree["texts"]]
    assert {"rewards/reward_func/mean", "rewards/accuracy_func/mean", "eval_accuracy", "eval_tokens_per_s"} <= \
        metrics[0].keys()
    evaluated = json.loads((run_dir / "step_0001/eval.json").read_text())["answers"]
    assert [a["greedy_reward"] for a in evaluated] == [0.1 * len(a["greedy"]) for a in evaluated]


def test_a_trl_jsonl_of_chat_messages(prefect_server, tiny_model_dir, tmp_path, monkeypatch):
    """TRL's conversational format: completions reach the functions as assistant messages."""
    from flows.train import train

    (tmp_path / "chat_rewards_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} * 2?"}],
                                        "solution": str(2 * i)}) + "\n" for i in range(6)))
    run_dir = tmp_path / "run"
    metrics = train(overrides=overrides(run_dir, tiny_model_dir, data, "reward.functions=[chat_rewards_15."
                                        "format_reward_func,chat_rewards_15.async_reward_func]"))
    assert metrics[0]["rewards/format_reward_func/mean"] == 0.0  # no <think> from a random model
    for tree in trees(run_dir):
        assert tree["reward_functions"]["async_reward_func"] == [float(bool(t)) for t in tree["texts"]]
