"""Tools and environments for episodes: schemas, the tool-call format, calls and their errors,
the chat template's tokens for what the environment appends (SmolLM2's template, which
ignores tools=), replay into fresh instances at forks, and the errors that name the fix."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

import pytest
from transformers import AutoTokenizer

from lsreplay.core.config import ConfigError, ModelConfig, load_config
from lsreplay.data.agentic import calculator
from lsreplay.data.environments import (Chat, EpisodeError, Episodes, ToolAnswer, call_tool, load_play,
                                        parse_reply, renders_tools, tool_schema)
from lsreplay.data.sources import Prompt
from lsreplay.models.loading import resolve_model_dir


def untyped(x):
    return x


async def slow_double(x: int) -> int:
    """Double a number, asynchronously.

    Args:
        x: the number
    """
    return 2 * x


class Counter:
    """An environment whose state is a count: `bump` adds to it, and the reward is the count."""

    def reset(self, **row) -> None:
        self.count = 0

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)


def episodes(tokenizer, overrides: list[str], prompt: str = "What is 3 + 4?", answer: str = "7") -> Episodes:
    # Openings render at construction, within data.max_prompt_tokens: two tools' schemas take ~330 tokens.
    cfg = load_config(None, ["rollout.max_turns=3", "data.max_prompt_tokens=512", *overrides])
    play = load_play(cfg.rollout)
    row = Prompt(0, "basic_arithmetic", prompt, answer, {}, {"answer": answer})
    return Episodes(play, Chat(tokenizer, play, cfg.data, [tokenizer.eos_token_id]), [row])


def reply(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text) + [tokenizer.eos_token_id]


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {str(arguments).replace(chr(39), chr(34))}}}</tool_call>'


def test_a_typed_documented_function_has_a_schema_and_others_are_refused():
    schema = tool_schema(calculator, "calculator")["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    with pytest.raises(EpisodeError, match="a type hint on every parameter and a Google-style docstring"):
        tool_schema(untyped, "tool rollout.tools[0]")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.tools=[no_such_module.f]"], "tool rollout.tools[0] = 'no_such_module.f': no module named"),
    (["rollout.tools=[lsreplay.data.agentic.nothing]"], "has no function 'nothing'"),
    (["rollout.tools=[test_environments.untyped]"], "Google-style docstring"),
    (["rollout.tools=[lsreplay.data.agentic.calculator,lsreplay.data.agentic.calculator]"], "listed already"),
    (["rollout.environment=test_environments.Missing"], "environment rollout.environment = "
                                                        "'test_environments.Missing'"),
])
def test_bad_tools_and_environments_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_play(load_config(None, overrides).rollout)


def test_tool_calls_in_the_documented_format(tokenizer):
    schemas = [tool_schema(calculator, "calculator")]
    message = parse_reply(tokenizer, f"Let me compute. {call('calculator', expression='3+4')}", schemas)
    assert message == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+4"}}}]}
    assert parse_reply(tokenizer, "The answer is 7.", schemas) == {"role": "assistant", "content": "The answer is 7."}
    bad = parse_reply(tokenizer, "<tool_call>{calculator}</tool_call>", schemas)["tool_calls"][0]
    assert "not JSON" in bad["error"]
    assert "tool_calls" not in parse_reply(tokenizer, call("calculator", expression="1"), [])  # no tools offered


def test_the_tokenizers_own_parser_where_it_has_one():
    class Parsing:
        response_template = {"x-regex": "..."}

        def parse_response(self, text, prefix, tools):
            return {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}

    assert parse_reply(Parsing(), "anything", [tool_schema(calculator, "calculator")])["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]


def test_calls_answer_with_results_or_trls_errors():
    tools = {"calculator": calculator, "slow_double": slow_double}
    assert call_tool(tools, {"function": {"name": "slow_double", "arguments": {"x": 4}}}) == ToolAnswer(
        {"role": "tool", "name": "slow_double", "content": "8"}, False)
    assert call_tool(tools, {"function": {"name": "calculator", "arguments": {"expression": "1/0"}}}) == ToolAnswer(
        {"role": "tool", "name": "calculator", "content": "{'error': 'division by zero'}"}, True)
    assert call_tool(tools, {"function": {"name": "nope", "arguments": {}}}).message["content"] == \
        "{'error': 'Tool nope not found.'}"
    assert call_tool(tools, {"function": {"name": "calculator", "arguments": {"x": 1}}}).failed


HANG_SECONDS, TIMEOUT = 30.0, 0.5  # a call that hangs (its thread is left behind, asleep), and the limit


def hanging_sum(a: int, b: int) -> int:
    """Add two numbers, after a long wait.

    Args:
        a: the first
        b: the second
    """
    time.sleep(HANG_SECONDS)
    return a + b


async def hanging_double(x: int) -> int:
    """Double a number, asynchronously, after a long wait.

    Args:
        x: the number
    """
    await asyncio.sleep(HANG_SECONDS)
    return 2 * x


def test_a_tool_that_hangs_answers_as_a_failed_call_within_the_timeout(caplog):
    tools = {"hanging_sum": hanging_sum, "hanging_double": hanging_double, "calculator": calculator}
    for name, arguments in (("hanging_sum", {"a": 1, "b": 2}), ("hanging_double", {"x": 3})):
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="lsreplay.data.environments"):
            answer = call_tool(tools, {"function": {"name": name, "arguments": arguments}}, timeout=TIMEOUT)
        assert TIMEOUT <= time.monotonic() - started < TIMEOUT + 2
        assert answer == ToolAnswer({"role": "tool", "name": name,
                                     "content": f"{{'error': 'Tool {name} did not answer within 0.5 s.'}}"}, True, True)
        assert f"tool {name} did not answer within rollout.tool_timeout_seconds=0.5 s" in caplog.text
    fast = call_tool(tools, {"function": {"name": "calculator", "arguments": {"expression": "2+3"}}}, timeout=TIMEOUT)
    assert fast == ToolAnswer({"role": "tool", "name": "calculator", "content": "5"}, False)


def test_a_call_that_timed_out_is_not_replayed_and_a_hanging_environment_stops_naming_it(tokenizer):
    e = episodes(tokenizer, ["rollout.tools=[test_environments.hanging_sum,lsreplay.data.agentic.calculator]",
                             f"rollout.tool_timeout_seconds={TIMEOUT}"])
    first = reply(tokenizer, call("hanging_sum", a=1, b=2))
    answer = e.respond(0, first)
    assert "did not answer within 0.5 s" in tokenizer.decode(answer)
    second = first + answer + reply(tokenizer, call("calculator", expression="1+2"))
    started = time.monotonic()
    assert "3" in tokenizer.decode(e.respond(0, second))  # the earlier hanging call was not run again
    assert time.monotonic() - started < TIMEOUT
    assert e.outcome(0, second).tool_errors == 1

    hanging = episodes(tokenizer, ["rollout.environment=test_environments.HangingFeedback",
                                   f"rollout.tool_timeout_seconds={TIMEOUT}"])
    with pytest.raises(EpisodeError, match=r"HangingFeedback: its respond did not return within "
                                           r"rollout.tool_timeout_seconds=0.5 s \(an episode of prompt 0\)"):
        hanging.respond(0, reply(tokenizer, "It is 8"))


class HangingFeedback:
    """An environment whose answer never comes."""

    def respond(self, messages: list[dict]) -> str:
        time.sleep(HANG_SECONDS)
        return "Wrong."


def test_an_answer_longer_than_the_limit_is_not_shown_and_ends_the_episode(tokenizer, caplog):
    e = episodes(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]", "rollout.max_environment_tokens=5"])
    first = reply(tokenizer, call("calculator", expression="3+4"))
    with caplog.at_level(logging.WARNING, logger="lsreplay.data.environments"):
        assert e.respond(0, first) is None  # "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n": > 5 tokens
    assert "more than rollout.max_environment_tokens=5: not shown" in caplog.text
    assert e.outcome(0, first).tool_calls == 0  # ended as at the last turn: its calls count as not run


def test_smollm2s_template_gets_the_tools_in_its_system_message(tokenizer):
    e = episodes(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]"])
    assert not renders_tools(tokenizer, e.play.schemas, {})
    system = e.openings[0][0]
    assert system["role"] == "system" and '"name": "calculator"' in system["content"] and "<tool_call>" in system[
        "content"]
    assert tokenizer.decode(e.prompt_ids()[0]).endswith("<|im_start|>assistant\n")


def test_a_tool_episode_then_feedback_with_their_template_tokens(tokenizer):
    e = episodes(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]",
                             "rollout.environment=lsreplay.data.agentic.ArithmeticFeedback"])
    assert e.openings[0][-1]["content"].endswith("you will be told and may try again.")
    first = reply(tokenizer, call("calculator", expression="3+4"))
    tool = e.respond(0, first)
    assert tokenizer.decode(tool) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    second = first + tool + reply(tokenizer, "It is <answer>8</answer>")
    feedback = e.respond(0, second)
    assert tokenizer.decode(feedback) == "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    third = second + feedback + reply(tokenizer, "<answer>7</answer>")
    assert e.respond(0, third) is None  # right: the episode ends
    ended = e.outcome(0, third)
    assert (ended.tool_calls, ended.tool_errors, ended.reward, ended.answer) == (1, 0, 0.5, "<answer>7</answer>")
    assert [m["role"] for m in ended.messages] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert tokenizer.decode(e.prompt_ids()[0] + third).endswith(
        "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n<answer>7</answer><|im_end|>")


def test_forked_episodes_replay_their_own_history_into_fresh_instances(tokenizer):
    """Two replies to one history each continue from its state, not from each other's."""
    e = episodes(tokenizer, ["rollout.environment=test_environments.Counter"])
    first = reply(tokenizer, call("bump", by=2))
    shared = first + e.respond(0, first)
    left, right = shared + reply(tokenizer, call("bump", by=3)), shared + reply(tokenizer, call("bump", by=10))
    assert "5" in tokenizer.decode(e.respond(0, left)) and "12" in tokenizer.decode(e.respond(0, right))
    assert e.outcome(0, right + e.respond(0, right) + reply(tokenizer, "done")).reward == 12.0
    assert e.outcome(0, shared + reply(tokenizer, "done")).reward == 2.0


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with another chat template."""
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return changed


def test_a_template_that_is_not_prefix_preserving_is_refused(tokenizer):
    """A template that shows only the last assistant reply (as some drop earlier reasoning)."""
    dropping = with_template(tokenizer, (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    e = episodes(dropping, ["rollout.environment=lsreplay.data.agentic.ArithmeticFeedback"])
    with pytest.raises(EpisodeError, match="not prefix-preserving"):
        e.respond(0, reply(dropping, "It is 8"))


def turns_taken(completions, **kwargs) -> list[float]:
    """A TRL-style reward of multi-turn completions: the assistant messages in each."""
    return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]


def test_rewards_see_the_episodes_messages_and_the_environments_reward():
    from lsreplay.data.rewards import Reward

    row = Prompt(0, "basic_arithmetic", "What is 3 + 4?", "7", {}, {"answer": "7"})
    messages = [[[{"role": "assistant", "content": "8"}, {"role": "user", "content": "Wrong"},
                  {"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "7"}]]]
    args = ([row], [["7", "7"]], [[[1, 2], [3]]], None, messages, [[0.5, 1.0]])
    scored = Reward(load_config(None, ["reward.functions=[test_environments.turns_taken]"])).score(*args)
    assert scored.by_function == {"turns_taken": [[2.0, 1.0]], "environment": [[0.5, 1.0]]}
    assert scored.totals == [[2.5, 2.0]]
    alone = Reward(load_config(None, [])).score(*args)  # no reward.functions: no default checker beside it
    assert alone.by_function == {"environment": [[0.5, 1.0]]} and alone.totals == [[0.5, 1.0]]


def test_preflight_refuses_a_tool_without_a_schema_before_any_work(tiny_model_dir, tmp_path):
    from lsreplay.stages.preflight import preflight

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "data.size=8",
                             "data.prompts_per_step=2", "drafter.enabled=false", "rollout.max_turns=2",
                             "rollout.tools=[test_environments.untyped]"])
    with pytest.raises(EpisodeError, match="rollout.tools\\[0\\] = 'test_environments.untyped'"):
        preflight(cfg)
    assert not (tmp_path / "run" / "step_0000").exists()


def test_a_template_that_renders_tools_gets_them_through_tools(tokenizer):
    native = with_template(tokenizer, (
        "{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    e = episodes(native, ["rollout.tools=[lsreplay.data.agentic.calculator]"])
    assert e.chat.native and not any("<tools>" in m["content"] for m in e.openings[0])
    assert native.decode(e.prompt_ids()[0]).startswith('<|im_start|>system\n<tools>[{"type": "function"')
    first = reply(native, call("calculator", expression="2*3"))
    assert native.decode(e.respond(0, first)) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
