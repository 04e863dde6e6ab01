"""Tool calls in every common chat format, each read back from its own template's real
rendering: Qwen2.5 (Hermes' <tool_call>), Qwen3 (through the training template lsreplay
ships), Llama 3.1 and 3.2 (JSON with "parameters"), Mistral v0.3 ([TOOL_CALLS]); the
tokenizer's own response parser where it has one; malformed calls become errors, never a
crash; and the environment's tokens after a tool call are the template's.

The tokenizers are SmolLM2's with each family's template and its special tokens added (no hub
access here); the templates are TRL's copies of the models' own (tests/data/chat_templates)."""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lsreplay.core.config import ModelConfig, load_config
from lsreplay.data import chat_formats
from lsreplay.data.chat_formats import Chat, EpisodeError, parse_reply, tool_call_format
from lsreplay.data.environments import tool_schema
from lsreplay.models.loading import resolve_model_dir

TRL_TEMPLATES = importlib.resources.files("trl") / "chat_templates"
HERE = Path(__file__).parent / "data" / "chat_templates"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    return a * b


SCHEMAS = [tool_schema(multiply, "multiply")]
CALL = {"type": "function", "id": "call00001", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
# family: (template, its special tokens, bos, the end-of-turn token, the expected format)
FAMILIES = {
    "qwen2.5": ((TRL_TEMPLATES / "qwen2_5.jinja").read_text(), [], None, "<|im_end|>", "hermes"),
    "qwen3": ((TRL_TEMPLATES / "qwen3.jinja").read_text(), ["<think>", "</think>", "<tool_call>", "</tool_call>"],
              None, "<|im_end|>", "qwen3"),
    "llama3.1": ((TRL_TEMPLATES / "llama3_1.jinja").read_text(),
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", "llama3"),
    "llama3.2": ((TRL_TEMPLATES / "llama3_2.jinja").read_text(),
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", "llama3"),
    "mistral-v0.3": ((HERE / "mistral_v0_3.jinja").read_text(),
                     ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>", "mistral"),
}


@pytest.fixture(scope="module")
def smollm2():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)


def family_tokenizer(smollm2, family: str):
    template, specials, bos, eos, _ = FAMILIES[family]
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    tokenizer.eos_token = eos
    tokenizer.bos_token = bos
    return tokenizer


def written(tokenizer, reply: dict, template: str | None = None) -> list[int]:
    """The token ids the model writes for `reply` after a user's question, as its template
    renders it (up to and including its end-of-turn token)."""
    question = [{"role": "user", "content": "What is 3 times 4?"}]
    before = tokenizer.apply_chat_template(question, tools=SCHEMAS, add_generation_prompt=True, tokenize=False,
                                           chat_template=template)
    after = tokenizer.apply_chat_template(question + [reply], tools=SCHEMAS, tokenize=False, chat_template=template)
    assert after.startswith(before), "the generation prompt is not the start of the reply's rendering"
    text = after[len(before):]
    text = text[:text.index(tokenizer.eos_token) + len(tokenizer.eos_token)]
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_tool_call_is_read_back_from_its_templates_rendering(smollm2, family):
    tokenizer = family_tokenizer(smollm2, family)
    fmt = tool_call_format(tokenizer)
    assert fmt == FAMILIES[family][4]
    template = chat_formats.training_template(tokenizer)
    assert (template is not None) == (family == "qwen3")  # Qwen3's own is swapped for lsreplay's training template
    ids = written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [CALL]}, template)
    eos = {tokenizer.eos_token_id}
    assert ids[-1] in eos
    message = parse_reply(tokenizer, ids, eos, SCHEMAS, fmt)
    assert [c["function"] for c in message["tool_calls"]] == [CALL["function"]]
    assert message["content"] == ""
    plain = parse_reply(tokenizer, written(tokenizer, {"role": "assistant", "content": "It is 12."}, template), eos,
                        SCHEMAS, fmt)
    assert plain == {"role": "assistant", "content": "It is 12."}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_turn_renders_the_templates_tokens_after_the_call(smollm2, family):
    """The environment's tokens after a call: the template's tool message (and generation
    prompt), the reply before it rendered the same (prefix-preserving)."""
    tokenizer = family_tokenizer(smollm2, family)
    data = load_config(None, []).data
    chat = Chat(tokenizer, SCHEMAS, data, [tokenizer.eos_token_id])
    opening = [{"role": "user", "content": "What is 3 times 4?"}]
    reply = chat.reply(written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [CALL]}, chat.template))
    answer = {"role": "tool", "name": "multiply", "content": "12",
              **({"tool_call_id": reply["tool_calls"][0]["id"]} if "id" in reply["tool_calls"][0] else {})}
    ids = chat.continuation(opening + [reply], opening + [reply, answer])
    text = tokenizer.decode(ids)
    assert "12" in text and len(ids) < 40, text


def test_qwen3s_own_template_is_not_prefix_preserving_and_names_the_fix(smollm2, monkeypatch):
    tokenizer = family_tokenizer(smollm2, "qwen3")
    monkeypatch.setattr(chat_formats, "TRAINING_TEMPLATES", {})
    chat = Chat(tokenizer, SCHEMAS, load_config(None, []).data, [tokenizer.eos_token_id])
    assert chat.template is None
    opening = [{"role": "user", "content": "What is 3 times 4?"}]
    reply = chat.reply(written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [CALL]}))
    with pytest.raises(EpisodeError, match="not prefix-preserving.*training templates"):
        chat.continuation(opening + [reply], opening + [reply, {"role": "tool", "content": "12"}])


def test_qwen3s_reasoning_is_read_apart_from_the_call(smollm2):
    tokenizer = family_tokenizer(smollm2, "qwen3")
    text = '<think>\nThree times four.\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n' \
           '</tool_call><|im_end|>'
    message = parse_reply(tokenizer, tokenizer.encode(text, add_special_tokens=False), {tokenizer.eos_token_id},
                          SCHEMAS, "qwen3")
    assert message["reasoning_content"] == "Three times four."
    assert message["tool_calls"][0]["function"] == CALL["function"]


@pytest.mark.parametrize("family, text, error", [
    ("qwen2.5", "<tool_call>\n{multiply}\n</tool_call>", "not JSON"),
    ("qwen2.5", '<tool_call>\n{"name": "multiply", "arguments": {"a": 3', "no closing </tool_call>"),
    ("qwen2.5", '<tool_call>\n{"arguments": {}}\n</tool_call>', "no name"),
    ("llama3.1", '<|python_tag|>{"name": "multiply", "parameters": {"a": 3}', "not JSON"),
    ("llama3.1", '{"name": "multiply", "parameters": {"a": 3, "b": 4}} and more', "text after"),
    ("mistral-v0.3", '[TOOL_CALLS] [{"name": "multiply", "arguments": ', "not a JSON list"),
    ("mistral-v0.3", '[TOOL_CALLS] [{"arguments": {}}]', "no name"),
])
def test_a_malformed_call_becomes_an_error_never_a_crash(smollm2, family, text, error):
    tokenizer = family_tokenizer(smollm2, family)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    message = parse_reply(tokenizer, ids, {tokenizer.eos_token_id}, SCHEMAS, FAMILIES[family][4])
    assert len(message["tool_calls"]) == 1 and error in message["tool_calls"][0]["error"]
    chat = Chat(tokenizer, SCHEMAS, load_config(None, []).data, [tokenizer.eos_token_id])
    assert "tool_calls" not in chat_formats.rendered(message)  # the template renders its text as content


def test_later_mistral_tokenizers_write_a_name_then_its_arguments(smollm2):
    tokenizer = family_tokenizer(smollm2, "mistral-v0.3")
    text = '[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 1, "b": 2}'
    message = parse_reply(tokenizer, tokenizer.encode(text, add_special_tokens=False), set(), SCHEMAS, "mistral")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [{"a": 3, "b": 4}, {"a": 1, "b": 2}]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])


def test_the_tokenizers_own_response_parser_where_it_has_one(smollm2):
    """transformers' declarative response template, read by its own parser (TRL's for Qwen3)."""
    tokenizer = family_tokenizer(smollm2, "qwen2.5")
    tokenizer.response_template = {
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                  "content": "json", "transform": {"type": "function", "function": "{content}"}},
                   "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    assert tool_call_format(tokenizer) == "response_template"
    ids = written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [CALL]})
    message = parse_reply(tokenizer, ids, set(), SCHEMAS, "response_template")
    assert [c["function"] for c in message["tool_calls"]] == [CALL["function"]]
    broken = parse_reply(tokenizer, tokenizer.encode("<tool_call>{no json</tool_call>"), set(), SCHEMAS,
                         "response_template")
    assert "could not be read" in broken["tool_calls"][0]["error"]
