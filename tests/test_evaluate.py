"""Held-out evaluation: a fixed prompt set training never samples, the stage's greedy and
sampled answers of the policy after `step` updates, and the intervals it reports."""

from __future__ import annotations

import json

import pytest
import torch

from lsreplay import stages
from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from lsreplay.data.evaluation import mean_interval, wilson_interval
from lsreplay.data.prompt_sets import heldout_prompts, training_prompts
from lsreplay.data.rendering import render_prompt
from lsreplay.models.loading import eos_ids, load_tokenizer
from lsreplay.stages.common import policy_before
from lsreplay.stages.preflight import preflight


def test_wilson_interval_matches_published_values():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(64, 64)[1] == 1.0 and wilson_interval(64, 64)[0] == pytest.approx(0.9434, abs=1e-4)
    assert mean_interval([0.0, 0.0, 0.0]) == (0.0, 0.0)  # never outside the values' range
    lo, hi = mean_interval([0.0, 1.0, 0.5, 0.5])
    assert 0 <= lo < 0.5 < hi <= 1


def own_file(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "1", "task": "basic_arithmetic"}) + "\n"
                            for q in questions))
    return path


def test_heldout_set_is_fixed_distinct_and_never_trained_on(tmp_path):
    # 30 rows, 20 distinct questions: a held-out question's duplicates leave training too.
    questions = [f"{i % 20} + 1 = ?" for i in range(30)]
    data = own_file(tmp_path / "data.jsonl", questions)
    base = [f"data.path={data}", "eval.every=1", "eval.size=8", "data.prompts_per_step=2"]
    heldout = heldout_prompts(load_config(None, base))
    held = set(heldout.column("question"))
    assert len(heldout) == 8 == len(held)
    assert heldout.rows == heldout_prompts(load_config(None, [*base, "seed=7"])).rows  # not the run's seed
    training = training_prompts(load_config(None, base))
    assert training.column("question") == [q for q in questions if q not in held]
    assert len(training_prompts(load_config(None, [f"data.path={data}"]))) == 30  # evaluation off: every row

    evals = own_file(tmp_path / "eval.jsonl", ["a", "a", "b", "c", "4 + 1 = ?"])
    from_file = heldout_prompts(load_config(None, [*base, f"eval.path={evals}", "eval.size=3"]))
    assert from_file.column("question") == ["a", "b", "c"]
    assert len(training_prompts(load_config(None, [*base, f"eval.path={evals}", "eval.size=4"]))) == 30 - 2


@pytest.fixture
def run(tiny_model_dir, tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "data.size=16",
                             "eval.every=1", "eval.size=6", "eval.samples=3", "data.prompts_per_step=1",
                             "rollout.branching=[2,2]", "rollout.segment_tokens=[2]", "rollout.max_new_tokens=5",
                             "drafter.enabled=false", "optim.lr=1e-2", "steps=1"])
    return preflight(cfg)


def greedy_texts(run: Run, step: int) -> list[str]:
    """Plain HF greedy decoding of the held-out prompts by the policy after `step` updates."""
    cfg, model = run.cfg, policy_before(run, step)
    tokenizer, prompts = load_tokenizer(cfg.model), heldout_prompts(cfg)
    texts = []
    for i in range(len(prompts)):
        ids = torch.tensor([render_prompt(tokenizer, prompts[i], cfg.data)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=cfg.rollout.max_new_tokens, eos_token_id=eos_ids(tokenizer, model),
                             pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def test_eval_stage_answers_with_the_policy_after_step_updates(run):
    """Step 0: the base model; step 1: the policy after step 0's update. Greedy answers are
    plain greedy decoding; the stage is skipped once done, like every other."""
    manifest = stages.evaluate_policy(run, 0)
    answers = json.loads((run.store.read_bytes("step_0000/eval.json")))["answers"]
    assert [a["prompt_index"] for a in answers] == heldout_prompts(run.cfg).rows
    assert [a["greedy"] for a in answers] == greedy_texts(run, 0)
    assert all(len(a["samples"]) == len(a["sample_rewards"]) == 3 for a in answers)
    correct = sum(a["greedy_reward"] >= 1 for a in answers)
    assert manifest["accuracy"] == correct / 6 and manifest["prompts"] == 6
    assert (manifest["accuracy_lo"], manifest["accuracy_hi"]) == wilson_interval(correct, 6)
    assert manifest["reward"] == pytest.approx(sum(sum(a["sample_rewards"]) for a in answers) / 18)
    assert manifest["sample_accuracy"] == pytest.approx(sum(x >= 1 for a in answers for x in a["sample_rewards"]) / 18)
    assert manifest["sample_accuracy_lo"] <= manifest["sample_accuracy"] <= manifest["sample_accuracy_hi"]
    assert stages.evaluate_policy(run, 0) == manifest and run.executions() == {(0, "eval"): 1}

    for stage in (stages.sample_prompts, stages.generate_trees, stages.cache_prefixes, stages.train_policy):
        stage(run, 0)
    stages.evaluate_policy(run, 1)
    after = [a["greedy"] for a in json.loads(run.store.read_bytes("step_0001/eval.json"))["answers"]]
    assert after == greedy_texts(run, 1)


def test_evaluated_steps():
    cfg = load_config(None, ["steps=7", "eval.every=3"])
    assert [s for s in range(8) if stages.evaluated(cfg, s)] == [0, 3, 6, 7]
    assert not any(stages.evaluated(load_config(None, ["steps=7"]), s) for s in range(8))
