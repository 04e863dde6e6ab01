"""A reward model's folder as a reward function, as TRL's GRPOTrainer takes a model id:
a sequence-classification model scoring the prompt with the completion, named by its
folder, weighted with the other functions; a model id not on this machine says so."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForSequenceClassification, TrainerState

from lsreplay.core.config import load_config
from lsreplay.data.rewards import Reward, RewardError
from lsreplay.data.sources import Prompt

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def one_at_a_time(folder, texts: list[str]) -> list[float]:
    """The model's first logit on each text alone, tokenized as TRL tokenizes it for a reward
    model (add_special_tokens=False; GRPOTrainer._calculate_rewards): no padding involved."""
    model = LlamaForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        return [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                for t in texts]


def test_a_reward_model_scores_prompt_and_completion_as_trl(tiny_reward_model_dir):
    r = Reward(load_config(None, [f"reward.functions=[{tiny_reward_model_dir}]"]))
    assert [(f.name, f.style) for f in r.functions] == [("tiny-rm", "model")]  # TRL: the path's last part
    prompts = [Prompt(0, "", "The sky is", "", {}), Prompt(1, "", CHAT, "", {})]
    completions = [[" blue.", " green, as it is on every third Tuesday."], ["4"]]
    scores = r.score(prompts, completions, [[[1], [2]], [[3]]], TrainerState())
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    texts = ["The sky is blue.", "The sky is green, as it is on every third Tuesday.",
             tokenizer.apply_chat_template(CHAT + [{"role": "assistant", "content": "4"}], tokenize=False)]
    expected = one_at_a_time(tiny_reward_model_dir, texts)
    got = [v for row in scores.totals for v in row]
    assert got == pytest.approx(expected, abs=1e-5)  # padded on the right, in one batch
    assert len(set(got)) == 3


def test_a_reward_model_is_weighted_with_the_functions(tiny_reward_model_dir, tmp_path, monkeypatch):
    (tmp_path / "rm_mix_15.py").write_text("def length(completions, **kwargs):\n"
                                           "    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    r = Reward(load_config(None, [f"reward.functions=[{tiny_reward_model_dir},rm_mix_15.length]", "reward.weights=[2,1]"]))
    scores = r.score([Prompt(0, "", "The sky is", "", {})], [[" blue."]], [[[1]]], TrainerState())
    (model_score,) = one_at_a_time(tiny_reward_model_dir, ["The sky is blue."])
    assert scores.totals == [[pytest.approx(2 * model_score + 6)]]
    assert set(scores.by_function) == {"tiny-rm", "length"}


def test_a_model_id_that_is_not_here_says_nothing_is_downloaded():
    with pytest.raises(RewardError, match="reward model 'someorg/no-such-reward-model-15': not a model folder here, nor "
                                          "a model id in the local Hugging Face cache"):
        Reward(load_config(None, ["reward.functions=[someorg/no-such-reward-model-15]"]))
    with pytest.raises(RewardError, match="takes no keywords"):
        Reward(load_config(None, ["reward.functions=[someorg/no-such-reward-model-15]", "reward.kwargs=[{a: 1}]"]))
