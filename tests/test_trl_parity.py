"""lsreplay against TRL itself (trl, the dev extra; skipped where it is not installed): a real
GRPOTrainer of a tiny model renders the same rows to the same prompt token ids, calls the same
reward functions with the same keywords and values, scores a reward model alike, names the
functions alike, and collects what they log alike."""

from __future__ import annotations

import functools
import json
import math

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from conftest import tiny_model
from lsreplay.core.config import load_config
from lsreplay.data.rendering import render_prompt
from lsreplay.data.rewards import Reward
from lsreplay.data.sources import PromptSet
from trl_rendering import save_llama_style_tokenizer, trl_prompt_ids

trl = pytest.importorskip("trl")

# Rows as TRL's docs and verl's data preparation write them: string prompts with a solution
# column, chat messages (one ending in an assistant's message), a nested verl field.
ROWS = [
    {"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "solution": "2", "ground_truth": "2",
     "reward_model": {"style": "rule", "ground_truth": "2"}},
    {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "solution": "5", "ground_truth": "5",
     "reward_model": {"style": "rule", "ground_truth": "5"}},
]
CHAT_ROWS = [
    {"prompt": [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}], "solution": "12"},
    {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "Let me see:"}], "solution": "4"},
]
COMPLETIONS = [[r" The solution is \boxed{2}.", " x is 2"], [r" \boxed{6}", r" The solution is \boxed{5}."]]
CALLS: list[dict] = []


def recording(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """Keeps what it is given; logs as TRL's Example 6 does."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "trainer_state": type(trainer_state).__name__, **kwargs})
    log_extra("length", [len(str(c)) for c in completions])
    log_metric("batch_size", float(len(completions)))
    return [float(len(ids)) if "2" in str(c) else None for c, ids in zip(completions, completion_ids)]


def scaled(completions, scale, **kwargs):
    return [scale * len(str(c)) for c in completions]


half = functools.partial(scaled, scale=0.5)


class Counter:
    def __call__(self, completions, **kwargs):
        return [float(str(c).count("2")) for c in completions]


counter = Counter()
FUNCTIONS = [recording, half, counter]
SPECS = ["test_trl_parity.recording", "test_trl_parity.half", "test_trl_parity.counter"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("llama-style")
    save_llama_style_tokenizer(tiny_model_dir, out)
    return out


@pytest.fixture(scope="module")
def trainer(tokenizer_dir, tiny_reward_model_dir, tmp_path_factory):
    """TRL's own GRPOTrainer over a tiny random model, with the functions and the reward model."""
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # bf16=False: TRL's default bf16 autocast would score the reward model in bf16, lsreplay in float32.
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=4)
    model = tiny_model("llama", vocab=len(tokenizer), dtype=torch.float32)
    return GRPOTrainer(model=model, reward_funcs=[*FUNCTIONS, str(tiny_reward_model_dir)], args=args,
                       train_dataset=datasets.Dataset.from_list(ROWS), processing_class=tokenizer)


def dataset(tmp_path, rows) -> tuple[str, list[dict]]:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), list(datasets.load_dataset("json", data_files=str(path), split="train"))


@pytest.mark.parametrize("rows, kwargs", [(ROWS, {}), (CHAT_ROWS, {}), (CHAT_ROWS, {"enable_thinking": False})])
def test_prompts_render_as_trls_grpo_trainer_renders_them(rows, kwargs, trainer, tokenizer_dir, tmp_path):
    """A data.path's prompts, nothing added: strings with the tokenizer's BOS, messages through
    the template with the generation prompt (after a last assistant message too), and
    data.chat_template_kwargs as TRL's chat_template_kwargs."""
    path, loaded = dataset(tmp_path, rows)
    trainer.chat_template_kwargs = kwargs
    expected = trainer._tokenize_prompts([row["prompt"] for row in loaded])[0]
    cfg = load_config(None, [f"data.path={path}", f"data.chat_template_kwargs={json.dumps(kwargs)}"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = PromptSet.from_file(path, required=("question",))
    assert [render_prompt(tokenizer, prompts[i], cfg.data) for i in range(len(rows))] == [list(e) for e in expected]
    assert [trl_prompt_ids(tokenizer, row["prompt"], kwargs) for row in loaded] == [list(e) for e in expected]
    if isinstance(rows[0]["prompt"], str):
        assert all(ids[0] == tokenizer.bos_token_id for ids in expected)


def trl_call(trainer, loaded: list[dict], tokenizer) -> tuple[torch.Tensor, dict, dict]:
    """TRL's _calculate_rewards on the rows' completions (each row's repeated per completion)."""
    inputs = [row for row, cs in zip(loaded, COMPLETIONS) for _ in cs]
    flat = [c for cs in COMPLETIONS for c in cs]
    completions = flat if isinstance(loaded[0]["prompt"], str) else [[{"role": "assistant", "content": c}]
                                                                      for c in flat]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in flat]
    trainer._pending_metrics.clear()
    trainer._pending_extra_logs.clear()
    values = trainer._calculate_rewards(inputs, [row["prompt"] for row in inputs], completions, ids)
    return values, dict(trainer._pending_metrics), {k: list(v) for k, v in trainer._pending_extra_logs.items()}


@pytest.mark.parametrize("rows", [ROWS, CHAT_ROWS])
def test_reward_functions_and_models_get_and_give_what_they_do_in_trl(rows, trainer, tokenizer_dir,
                                                                       tiny_reward_model_dir, tmp_path):
    trainer.chat_template_kwargs = {}
    path, loaded = dataset(tmp_path, rows)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    CALLS.clear()
    trl_values, trl_metrics, trl_extras = trl_call(trainer, loaded, tokenizer)
    reward = Reward(load_config(None, [f"data.path={path}", f"reward.functions=[{','.join(SPECS)},"
                                       f"{tiny_reward_model_dir}]"]))
    assert [f.name for f in reward.functions] == trainer.reward_func_names == ["recording", "scaled", "Counter",
                                                                              "tiny-rm"]
    prompts = PromptSet.from_file(path, required=("question",))
    ids = [[tokenizer(c, add_special_tokens=False)["input_ids"] for c in cs] for cs in COMPLETIONS]
    scores = reward.score([prompts[i] for i in range(len(rows))], COMPLETIONS, ids, trainer.state)
    trl_call_kwargs, lsreplay_call_kwargs = CALLS
    assert lsreplay_call_kwargs == trl_call_kwargs  # every keyword, every value: prompts, columns, ...
    for k, name in enumerate(reward.names):
        ours = [v for row in scores.by_function[name] for v in row]
        theirs = [None if math.isnan(v) else v for v in trl_values[:, k].tolist()]
        assert ours == pytest.approx(theirs, abs=1e-5), name
    assert scores.metrics == trl_metrics
    assert {k: [v for row in vs for v in row] for k, vs in scores.extras.items()} == trl_extras
