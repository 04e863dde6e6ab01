"""Datasets as TRL and verl users bring them: a `prompt` column of text or chat messages,
nested columns, rendered as TRL renders them, and nothing added but what the config says;
the default config renders lsreplay's own prompts exactly as before."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from lsreplay.core.config import ANSWER_INSTRUCTION, load_config
from lsreplay.data.rendering import render_prompt
from lsreplay.data.sources import DatasetError, Prompt, PromptSet, generate_prompt_file
from trl_rendering import save_llama_style_tokenizer, trl_prompt_ids

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def old_render_prompt(tokenizer, prompt, system_prompt: str, max_tokens: int) -> list[int]:
    """stages/trees.py's render_prompt before datasets came as they are (the reference)."""
    messages = [{"role": "user", "content": prompt.question + ANSWER_INSTRUCTION}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def prompt(question) -> Prompt:
    return Prompt(index=0, task="", question=question, answer="5", metadata={})


@pytest.mark.parametrize("config", [None, "configs/default.yaml"])
def test_the_default_configs_render_the_same_ids_as_before(config, tokenizer, tmp_path):
    cfg = load_config(config, [])
    path = generate_prompt_file(tmp_path / "p.jsonl", list(cfg.data.tasks), 6, 0, dict(cfg.data.task_args))
    prompts = PromptSet.from_file(path)
    for i in range(len(prompts)):
        assert render_prompt(tokenizer, prompts[i], cfg.data) == old_render_prompt(
            tokenizer, prompts[i], cfg.data.system_prompt, cfg.data.max_prompt_tokens)


def test_your_prompts_as_trl_renders_them(tokenizer, tmp_path):
    """With data.path nothing is added: a string goes as it is (with the tokenizer's special
    tokens, as TRL's processing_class(text=...)), messages through the chat template with the
    generation prompt, a last assistant message too (TRL's GRPOTrainer._tokenize_prompts; the
    rules are tests/trl_rendering.py, checked against TRL itself in test_trl_parity)."""
    yours = load_config(None, [f"data.path={tmp_path / 'train.jsonl'}"]).data
    continued = MESSAGES + [{"role": "assistant", "content": "Let me see:"}]
    for question in ("The sky is", MESSAGES, continued):
        assert render_prompt(tokenizer, prompt(question), yours) == trl_prompt_ids(tokenizer, question)
    assert tokenizer.decode(render_prompt(tokenizer, prompt(continued), yours)).endswith(
        "Let me see:<|im_end|>\n<|im_start|>assistant\n")
    thinking_off = load_config(None, ["data.path=t.jsonl", "data.chat_template_kwargs={enable_thinking: false}"])
    assert render_prompt(tokenizer, prompt(MESSAGES), thinking_off.data) == trl_prompt_ids(tokenizer, MESSAGES)


def test_string_prompts_get_the_tokenizers_bos_as_in_trl(tiny_model_dir, tmp_path):
    """A Llama-family tokenizer adds BOS to a string prompt (TRL's processing_class(text=...));
    none is doubled where the chat template writes one."""
    bos = save_llama_style_tokenizer(tiny_model_dir, tmp_path / "tokenizer")
    yours = load_config(None, ["data.path=train.jsonl"]).data
    assert render_prompt(bos, prompt("The sky is"), yours) == [bos.bos_token_id] + bos(
        "The sky is", add_special_tokens=False)["input_ids"]
    templated = render_prompt(bos, prompt(MESSAGES), yours)
    assert templated == trl_prompt_ids(bos, MESSAGES) and templated[1] != bos.bos_token_id
    thinking_off = load_config(None, ["data.path=t.jsonl", "data.chat_template_kwargs={enable_thinking: false}"])
    text = bos.decode(render_prompt(bos, prompt(MESSAGES), thinking_off.data))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_only_what_the_config_asks_is_added(tokenizer):
    """lsreplay's own prompts get its system prompt and <answer> instruction; a dataset's only
    when the config says so, and never over a system message of its own."""
    default = load_config(None, []).data
    text = tokenizer.decode(render_prompt(tokenizer, prompt(MESSAGES), default))
    assert text.count(default.system_prompt) == 1 and (MESSAGES[0]["content"] + ANSWER_INSTRUCTION) in text
    own_system = [{"role": "system", "content": "Be terse."}] + MESSAGES
    text = tokenizer.decode(render_prompt(tokenizer, prompt(own_system), default))
    assert "Be terse." in text and default.system_prompt not in text
    asked = load_config(None, ["data.path=t.jsonl", "data.answer_instruction=' Answer with a number.'"]).data
    assert tokenizer.decode(render_prompt(tokenizer, prompt("The sky is"), asked)) == "The sky is Answer with a number."
    with pytest.raises(DatasetError, match="data.system_prompt is set, but string prompts go to the model as they "
                                           "are .data.chat_template=false."):
        render_prompt(tokenizer, prompt("The sky is"), load_config(None, ["data.path=t.jsonl",
                                                                          "data.system_prompt=Be terse."]).data)


def test_example_messages_come_between_the_system_message_and_the_prompts_own(tokenizer):
    examples = ["data.example_messages=[{role: user, content: 'What is 1 + 1?'}, {role: assistant, content: '2'}]"]
    data = load_config(None, [*examples, "data.system_prompt=Be terse.", "data.answer_instruction=' Be brief.'"]).data
    text = tokenizer.decode(render_prompt(tokenizer, prompt("What is 2 + 3?"), data))
    assert text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
                    "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nWhat is 2 + 3? Be brief.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with pytest.raises(DatasetError, match="data.example_messages is set, but string prompts go to the model as"):
        render_prompt(tokenizer, prompt("The sky is"), load_config(None, ["data.path=t.jsonl", *examples]).data)


def verl_rows(n: int = 6) -> list[dict]:
    """Rows as verl's data preparation writes them (docs: Prepare Data for Post-Training)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the "
                                                    "final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_a_verl_parquet_loads_with_nested_columns(tmp_path):
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    prompts = PromptSet.from_file(path, columns={"answer": "reward_model.ground_truth", "task": "ability"},
                                  required=("question", "answer"))
    p = prompts[3]
    assert p.question == verl_rows()[3]["prompt"] and p.answer == "6" and p.task == "math"
    assert p.columns["reward_model"] == {"style": "rule", "ground_truth": "6"} and "prompt" not in p.columns
    assert p.columns["extra_info"] == {"split": "train", "index": 3} and p.metadata["data_source"] == "openai/gsm8k"
    assert prompts.column("answer")[:3] == ["0", "2", "4"]
    with pytest.raises(DatasetError, match=r"column 'reward_model.truth'.*fields \['data_source', 'prompt', "
                                           r"'ability', 'reward_model.style', 'reward_model.ground_truth'"):
        PromptSet.from_file(path, columns={"answer": "reward_model.truth"}, required=("question", "answer"))


def test_a_question_column_keeps_working_and_prompt_names_another(tmp_path):
    path = tmp_path / "own.jsonl"
    rows = [{"question": "q1", "prompt": "p1", "text": "t1", "answer": "1", "task": "exact_answer"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert PromptSet.from_file(path)[0].question == "p1"  # TRL's column, where there is one
    assert PromptSet.from_file(path, columns={"prompt": "text"})[0].question == "t1"
    assert PromptSet.from_file(path, columns={"question": "text"})[0].question == "t1"  # the older key
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "q1", "answer": "1", "task": "exact_answer"}) + "\n")
    assert PromptSet.from_file(tmp_path / "q.jsonl")[0].question == "q1"


def test_prompts_of_the_wrong_shape_name_the_column_and_row(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(json.dumps({"prompt": i, "answer": "1", "task": "exact_answer"}) + "\n" for i in range(3)))
    with pytest.raises(DatasetError, match="column 'prompt' holds int64, not prompts; expected a string or a list "
                                           "of chat messages"):
        PromptSet.from_file(path)
    path = tmp_path / "nulls.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": None}, {"prompt": []}]
    path.write_text("".join(json.dumps({**r, "answer": "1", "task": "exact_answer"}) + "\n" for r in rows))
    prompts = PromptSet.from_file(path)
    with pytest.raises(DatasetError, match=r"column 'prompt', row 1: None \(NoneType\) is not a prompt; expected a "
                                           "string, or a list of chat messages with role and content strings"):
        prompts.check_prompts()
    with pytest.raises(DatasetError, match="column 'prompt', row 2: "):
        prompts[2]
