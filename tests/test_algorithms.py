"""The algorithms of docs/algorithms.md through the pipeline's stages on a tiny model: PPO
with a critic (checkpointed beside the policy, out of its HF folder), online DPO over each
tree's best and worst leaf, offline DPO from a preference dataset (no rollouts), and a
step that trains nothing saying why. Replay's exactness for each loss is
test_replay_equivalence's; resuming PPO with a critic, an LR schedule and dynamic sampling
bit for bit is test_resume's."""

from __future__ import annotations

import json
import logging
import math

import pytest
from flowrun import tree_records
from safetensors.torch import load_file
from transformers import AutoTokenizer

from lsreplay import stages

from lsreplay.core.config import load_config
from lsreplay.data.preferences import Preference, preference_record
from lsreplay.stages.preflight import preflight
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT


def run_steps(tmp_path, model_dir, overrides: list[str], steps: int = 1):
    """A run of `steps` steps stage by stage (no flow): the manifests of its last step."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", "data.size=16",
                             "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
                             "rollout.max_new_tokens=6", "drafter.enabled=false", "optim.lr=1e-3",
                             "reward.function=varied_rewards:code_parity", f"steps={steps}", *overrides])
    run = preflight(cfg)
    run.save_or_check_config()
    for step in range(steps):
        manifests = {name: stage(run, step) for name, stage in (
            ("prompts", stages.sample_prompts), ("trees", stages.generate_trees), ("prefixes", stages.cache_prefixes),
            ("policy", stages.train_policy))}
    checkpointing.WRITER.wait()
    RESIDENT.release(run)
    return run, manifests


def test_ppo_with_a_critic(tiny_model_dir, tmp_path, caplog):
    """Two epochs of two minibatches with GAE from the critic: four updates, the first on the
    caching pass's stored K/V (nothing recomputed), the value head trained at its own rate
    and checkpointed in critic.safetensors, beside the policy and out of its HF folder."""
    with caplog.at_level(logging.WARNING):
        run, m = run_steps(tmp_path, tiny_model_dir, ["algo.name=ppo", "algo.critic=true", "algo.advantage=gae",
                                                      "algo.epochs=2", "algo.minibatches=2", "algo.value_lr=1e-2"])
    assert not [r for r in caplog.records if "recomput" in r.getMessage()]
    policy = m["policy"]
    assert policy["updates"] == 4 and policy["learning_rate"] == 1e-3
    assert policy["value_loss"] > 0 and 0 <= policy["value_clip_fraction"] <= 1
    assert policy["value_explained_variance"] == 0.0  # the head starts at zero: V = 0 explains nothing
    assert m["prefixes"]["activations"]  # old logprobs and values scored
    folder = tmp_path / "run" / policy["checkpoint"]
    critic = load_file(str(folder / "critic.safetensors"))
    assert critic.keys() == {"value_head.weight", "value_head.bias"} and critic["value_head.weight"].abs().max() > 0
    assert not any("value_head" in k for k in load_file(str(folder / "model.safetensors")))
    assert not any("value_head" in k for k in load_file(str(folder / "hf/model.safetensors")))
    groups = json.loads((folder / "optimizer.json").read_text())["param_groups"]
    assert [g["lr"] for g in groups] == [1e-3, 1e-2]


def test_online_dpo_pairs_each_trees_best_and_worst_leaf(tiny_model_dir, tmp_path):
    """Prompts of even index score all their leaves alike: those trees give no pair and are
    counted. At the first step the policy is the reference: every margin is 0, loss log 2.
    Replay runs the prompts and the paired leaves only."""
    _, m = run_steps(tmp_path, tiny_model_dir, ["algo.name=dpo", "data.prompts_per_step=4",
                                                 "reward.function=varied_rewards:alike_on_even_prompts"])
    records = tree_records(tmp_path / "run", 0)
    alike = sum(len(set(r["rewards"])) == 1 for r in records)
    assert 0 < alike < 4 and m["trees"]["trees_all_alike"] == alike
    policy = m["policy"]
    assert policy["dpo_pairs"] == 4 - alike and policy["dpo_unpaired_trees"] == alike
    assert policy["loss"] == pytest.approx(math.log(2), abs=1e-6) and policy["dpo_reward_margin"] == 0.0
    paired = [r for r in records if len(set(r["rewards"])) > 1]
    assert policy["per_rollout_positions"] == sum(2 * len(r["prompt_ids"]) + len(r["completions"][r["rewards"].index(
        max(r["rewards"]))]) + len(r["completions"][r["rewards"].index(min(r["rewards"]))]) for r in paired)
    assert 0 < policy["positions"] < policy["per_rollout_positions"]


def test_offline_dpo_from_a_preference_dataset(tiny_model_dir, tmp_path):
    """A row is a tree of two leaves sharing its prompt: built from the dataset with no model
    and no rollouts, the caching pass and replay compute the prompt once for both answers."""
    rows = tmp_path / "prefs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}? Answer with a number.",
                                        "chosen": str(2 * i), "rejected": f"I think it is {i}."}) + "\n"
                            for i in range(6)))
    run, m = run_steps(tmp_path, tiny_model_dir, ["algo.name=dpo", "algo.dpo_source=dataset", f"data.path={rows}",
                                                   "algo.dpo_beta=0.5"], steps=2)
    assert m["trees"]["forward_positions"] == 0 and m["trees"]["rollouts"] == 4  # nothing generated
    records = tree_records(tmp_path / "run", 1)
    assert all(len(r["completions"]) == 2 and r["rewards"] == [1.0, 0.0] for r in records)
    policy = m["policy"]
    assert policy["dpo_pairs"] == 2 and policy["loss"] < math.log(2)  # step 0 moved towards the chosen answers
    assert policy["dpo_reward_margin"] > 0
    prompts = sum(len(r["prompt_ids"]) for r in records)
    answers = sum(len(c) for r in records for c in r["completions"])
    assert policy["per_rollout_positions"] == 2 * prompts + answers and policy["positions"] < 2 * prompts


def test_chat_preferences_render_with_the_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pref = Preference(0, [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}],
                      [{"role": "assistant", "content": "5"}])
    record = preference_record(tokenizer, pref, 256, 48)
    prompt = tokenizer.apply_chat_template(pref.prompt, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(record["prompt_ids"]) == prompt
    assert [tokenizer.decode(c) for c in record["completions"]] == ["4<|im_end|>\n", "5<|im_end|>\n"]


def test_chat_preferences_get_the_chat_template_kwargs(tiny_model_dir):
    """data.chat_template_kwargs reach the preference prompt and answers as they reach a
    rollout's prompt: here a template keyword that opens the conversation."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% if persona is defined %}{{ persona }}\n{% endif %}" + tokenizer.chat_template
    pref = Preference(0, [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}],
                      [{"role": "assistant", "content": "5"}])
    record = preference_record(tokenizer, pref, 256, 48, {"persona": "You count on fingers."})
    assert tokenizer.decode(record["prompt_ids"]).startswith("You count on fingers.\n")
    assert [tokenizer.decode(c) for c in record["completions"]] == ["4<|im_end|>\n", "5<|im_end|>\n"]
    assert "fingers" not in tokenizer.decode(preference_record(tokenizer, pref, 256, 48)["prompt_ids"])


def test_text_preferences_tokenize_as_rollouts_do_and_cut_long_answers(tiny_model_dir):
    """A text prompt gets the tokenizer's own special tokens (BOS here, as a Llama tokenizer
    adds it), as a rollout's text prompt does; an answer past the limit is cut there."""
    from lsreplay.core.config import DataConfig
    from lsreplay.data.rendering import render_prompt
    from lsreplay.data.sources import Prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_bos_token = True
    pref = Preference(0, "2+2=", " four, as everyone knows", " 5")
    record = preference_record(tokenizer, pref, 256, 3)
    as_rollout = render_prompt(tokenizer, Prompt(0, "", "2+2=", "", {}),
                               DataConfig(chat_template=False, system_prompt="", answer_instruction=""))
    assert record["prompt_ids"] == as_rollout and as_rollout[0] == tokenizer.bos_token_id
    chosen = tokenizer(" four, as everyone knows", add_special_tokens=False)["input_ids"]
    assert record["completions"][0] == chosen[:3] and record["finished"] == [False, True]
    assert record["completions"][1][-1] == tokenizer.eos_token_id


def test_a_step_that_trains_nothing_says_why(tiny_model_dir, tmp_path, caplog):
    """Within 6 tokens a random model never ends an answer: every one is cut at the limit, and
    masked out no loss weight is nonzero; replay runs nothing, and the log says why."""
    with caplog.at_level(logging.WARNING):
        _, m = run_steps(tmp_path, tiny_model_dir, ["reward.function=varied_rewards:alike_on_even_prompts",
                                                     "algo.overlong=mask", "algo.clip_eps_high=0.28"])
    assert m["policy"]["positions"] == 0
    message = next(r.getMessage() for r in caplog.records if "trains nothing" in r.getMessage())
    alike = m["trees"]["trees_all_alike"]
    assert f"{alike} of 2 trees have leaves that all got the same reward" in message
    assert "algo.dynamic_sampling=true replaces them" in message and "algo.overlong=mask left 8 of 8 answers out" in message


def test_dynamic_sampling_judges_on_accuracy_and_leaves_trees_still_alike_out(tiny_model_dir):
    """DAPO's filter: on the reward as the functions gave it by default, so an all-correct
    group whose lengths the overlong penalty tells apart is left out, not trained on length."""
    from lsreplay.stages.common import filter_values, left_out, training_rewards
    from lsreplay.stages.objectives import response_mask

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "algo.dynamic_sampling=true", "algo.overlong=penalty",
                             "algo.overlong_buffer=4", "rollout.max_new_tokens=8", "rollout.segment_tokens=[3]"])
    correct = {"rewards": [1.0, 1.0], "completions": [[1, 2], [1, 2, 3, 4, 5, 6, 7]], "finished": [True, True],
               "reward_functions": {"accuracy": [1.0, 1.0], "format": [0.0, 1.0]}}
    mixed = {**correct, "rewards": [1.0, 0.0]}
    assert len(set(training_rewards(cfg, correct))) == 2 and filter_values(cfg, correct) == [1.0, 1.0]
    assert left_out(cfg, [correct, mixed]) == [True, False]
    assert response_mask(cfg, [correct, mixed]) == [[False, False], [True, True]]
    by_format = load_config(None, [f"model.path={tiny_model_dir}", "algo.dynamic_sampling=true",
                                   "algo.dynamic_sampling_metric=rewards/format"])
    assert left_out(by_format, [correct, mixed]) == [False, False]
    unknown = load_config(None, ["algo.dynamic_sampling=true", "algo.dynamic_sampling_metric=rewards/length"])
    with pytest.raises(ValueError, match="no reward function is named 'length'.*accuracy"):
        left_out(unknown, [correct])
    assert left_out(load_config(None, []), [correct]) == [False]  # without dynamic sampling every tree is in


def test_k1_as_a_loss_term_is_refused_with_the_reason():
    from lsreplay.core.config import ConfigError

    with pytest.raises(ConfigError, match="algo.kl_estimator.*0 in expectation"):
        load_config(None, ["algo.kl_coef=0.1", "algo.kl_estimator=k1"])
    load_config(None, ["algo.kl_coef=0.1", "algo.kl_estimator=k2"])
