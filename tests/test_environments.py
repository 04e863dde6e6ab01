"""Tools and environments for episodes: schemas, calls and their errors, the chat template's
tokens for what the environment appends (SmolLM2's template, which ignores tools=), one live
instance per episode forked at branch points (every tool called once: a side-effect
counter), close() at every episode's end, async calls on one event loop, the journal a
resumed stage reads instead of calling tools again, and the errors that name the fix."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time

import pytest
from transformers import AutoTokenizer

from lsreplay.core.config import ConfigError, ModelConfig, load_config
from lsreplay.data.agentic import calculator
from lsreplay.data.chat_formats import Chat, EpisodeError, renders_tools
from lsreplay.data.environments import Calls, Episodes, ToolAnswer, call_tool, load_play, tool_schema
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


EFFECTS: list[str] = []  # what side_effect did, in order


def side_effect(what: str) -> str:
    """Do something that cannot be undone (here: append to a list), once per call.

    Args:
        what: what to do
    """
    EFFECTS.append(what)
    return f"done: {what}"


class Lifecycle:
    """An environment that counts its forks and closes, owns a handle (a lock: not deep-copyable),
    and answers get_reward with None (no reward of its own)."""

    forks, closes = 0, 0

    def reset(self, **row) -> str:
        self.handle, self.moves = threading.Lock(), []
        return " Move twice."

    def move(self, where: str) -> str:
        """Move somewhere.

        Args:
            where: the direction
        """
        self.moves.append(where)
        return ",".join(self.moves)

    def fork(self) -> Lifecycle:
        type(self).forks += 1
        twin = Lifecycle()
        twin.handle, twin.moves = threading.Lock(), list(self.moves)
        return twin

    def close(self) -> None:
        type(self).closes += 1

    def get_reward(self):
        return None


class Handle:
    """An environment holding a lock and no fork(): it can be neither forked nor copied."""

    def __init__(self):
        self.lock = threading.Lock()

    def poke(self) -> str:
        """Poke it."""
        return "ouch"


class TRLNames:
    """TRL offers every public method as a tool: here one named `respond` (not lsreplay's
    respond(messages) hook), and a callable attribute that is no tool."""

    def reset(self, **row) -> None:
        self.client = lambda: "not a tool"

    def respond(self, text: str) -> str:
        """Say something.

        Args:
            text: what to say
        """
        return text.upper()


LOOPS: set[int] = set()


class AsyncEnvironment:
    """An async environment: its reset opens a "client" on the running loop, its tool uses it."""

    async def reset(self, **row) -> None:
        self.loop = asyncio.get_running_loop()
        LOOPS.add(id(self.loop))

    async def ping(self) -> str:
        """Ping the client."""
        assert asyncio.get_running_loop() is self.loop, "a call ran on another event loop than reset's"
        LOOPS.add(id(asyncio.get_running_loop()))
        return "pong"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)


class Journal(dict):
    def put(self, key, entry):
        self[key] = entry


class Driver:
    """Episodes of one prompt, driven by hand as the sampler drives them."""

    def __init__(self, tokenizer, overrides: list[str], journal=None, prompt: str = "What is 3 + 4?", answer="7"):
        # Openings render at construction, within data.max_prompt_tokens: two tools' schemas take ~330 tokens.
        cfg = load_config(None, ["rollout.max_turns=3", "data.max_prompt_tokens=512", *overrides])
        self.tokenizer, self.play = tokenizer, load_play(cfg.rollout)
        self.calls = Calls(cfg.rollout.tool_timeout_seconds)
        row = Prompt(0, "basic_arithmetic", prompt, answer, {}, {"answer": answer})
        self.episodes = Episodes(self.play, Chat(tokenizer, self.play.schemas, cfg.data, [tokenizer.eos_token_id]),
                                 [row], self.calls, journal)

    def reply(self, parent, text: str, completion: list[int] = (), last: bool = True, ending: bool = False):
        """The parent's episode continued by a reply: (its state, the answer's ids, the completion)."""
        ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        child = self.episodes.branch(parent, last)
        completion = list(completion) + ids
        answer = self.episodes.respond(child, ids, completion, ending)
        return child, answer, completion + (answer or [])

    @property
    def root(self):
        return self.episodes.root(0)

    def close(self):
        self.calls.close()


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
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        load_play(load_config(None, overrides).rollout)


def test_calls_answer_with_results_or_trls_errors():
    tools = {"calculator": calculator, "slow_double": slow_double}
    with Calls() as calls:
        assert call_tool(tools, {"function": {"name": "slow_double", "arguments": {"x": 4}}}, calls) == ToolAnswer(
            {"role": "tool", "name": "slow_double", "content": "8"}, False)
        assert call_tool(tools, {"function": {"name": "calculator", "arguments": {"expression": "1/0"}}},
                         calls) == ToolAnswer({"role": "tool", "name": "calculator",
                                               "content": "{'error': 'division by zero'}"}, True)
        assert call_tool(tools, {"function": {"name": "nope", "arguments": {}}}, calls).message["content"] == \
            "{'error': 'Tool nope not found.'}"
        assert call_tool(tools, {"function": {"name": "calculator", "arguments": {"x": 1}}}, calls).failed


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
    with Calls(TIMEOUT) as calls:
        for name, arguments in (("hanging_sum", {"a": 1, "b": 2}), ("hanging_double", {"x": 3})):
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="lsreplay.data.environments"):
                answer = call_tool(tools, {"function": {"name": name, "arguments": arguments}}, calls)
            assert TIMEOUT <= time.monotonic() - started < TIMEOUT + 2
            assert answer == ToolAnswer({"role": "tool", "name": name, "content":
                                         f"{{'error': 'Tool {name} did not answer within 0.5 s.'}}"}, True, True)
            assert f"tool {name} did not answer within rollout.tool_timeout_seconds=0.5 s" in caplog.text
        fast = call_tool(tools, {"function": {"name": "calculator", "arguments": {"expression": "2+3"}}}, calls)
        assert fast == ToolAnswer({"role": "tool", "name": "calculator", "content": "5"}, False)


class HangingFeedback:
    """An environment whose answer never comes."""

    def respond(self, messages: list[dict]) -> str:
        time.sleep(HANG_SECONDS)
        return "Wrong."


def test_a_hanging_environment_stops_naming_it(tokenizer):
    hanging = Driver(tokenizer, ["rollout.environment=test_environments.HangingFeedback",
                                 f"rollout.tool_timeout_seconds={TIMEOUT}"])
    with pytest.raises(EpisodeError, match=r"HangingFeedback: its respond did not return within "
                                           r"rollout.tool_timeout_seconds=0.5 s \(an episode of prompt 0\)"):
        hanging.reply(hanging.root, "It is 8")
    hanging.close()


def test_an_answer_longer_than_the_limit_is_cut_to_fit(tokenizer, caplog):
    d = Driver(tokenizer, ["rollout.tools=[test_environments.side_effect]", "rollout.max_environment_tokens=16"])
    with caplog.at_level(logging.WARNING, logger="lsreplay.data.environments"):
        episode, answer, _ = d.reply(d.root, call("side_effect", what="x " * 40))
    assert 0 < len(answer) <= 16 and "its longest message is cut" in caplog.text
    text = tokenizer.decode(answer)
    assert text.startswith("\n<|im_start|>tool\ndone: x x") and text.endswith("…<|im_end|>\n<|im_start|>assistant\n")
    assert episode.messages[-1]["content"].endswith("…")  # what the model saw
    d.close()


def test_smollm2s_template_gets_the_tools_in_its_system_message(tokenizer):
    d = Driver(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]"])
    assert not renders_tools(tokenizer, d.play.schemas, {})
    system = d.root.opening[0]
    assert system["role"] == "system" and '"name": "calculator"' in system["content"] and "<tool_call>" in system[
        "content"]
    assert tokenizer.decode(d.episodes.prompt_ids()[0]).endswith("<|im_start|>assistant\n")
    d.close()


def test_a_tool_episode_then_feedback_with_their_template_tokens(tokenizer):
    d = Driver(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]",
                           "rollout.environment=lsreplay.data.agentic.ArithmeticFeedback"])
    assert d.root.opening[-1]["content"].endswith("you will be told and may try again.")
    first, tool, completion = d.reply(d.root, call("calculator", expression="3+4"))
    assert tokenizer.decode(tool) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    second, feedback, completion = d.reply(first, "It is <answer>8</answer>", completion)
    assert tokenizer.decode(feedback) == "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    third, end, completion = d.reply(second, "<answer>7</answer>", completion)
    assert end is None  # right: the episode ends, its reward read
    assert (third.tool_calls, third.tool_errors, third.reward, third.answer) == (1, 0, 0.5, "<answer>7</answer>")
    assert [m["role"] for m in third.messages] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert tokenizer.decode(d.episodes.prompt_ids()[0] + completion).endswith(
        "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n<answer>7</answer><|im_end|>")
    d.close()


def test_branches_fork_the_live_instance_and_no_tool_runs_twice(tokenizer):
    """Two replies to one history each continue from its state, not from each other's, and a
    tool with a side effect did it once per call: k calls, k effects."""
    EFFECTS.clear()
    d = Driver(tokenizer, ["rollout.environment=test_environments.Counter",
                           "rollout.tools=[test_environments.side_effect]"])
    first, _, shared = d.reply(d.root, call("bump", by=2))
    second, _, shared = d.reply(first, call("side_effect", what="a"), shared)
    left, left_answer, left_tokens = d.reply(second, call("bump", by=3), shared, last=False)
    right, right_answer, right_tokens = d.reply(second, call("bump", by=10), shared, last=True)
    assert "5" in tokenizer.decode(left_answer) and "12" in tokenizer.decode(right_answer)
    assert left.instance is not second.instance and right.instance is second.instance  # the last keeps the original
    ended, _, _ = d.reply(right, call("side_effect", what="b"), right_tokens, ending=False)
    done, end, _ = d.reply(ended, "done", ending=True)
    assert end is None and done.reward == 12.0
    assert d.reply(left, "done", left_tokens, ending=True)[0].reward == 5.0
    assert EFFECTS == ["a", "b"]
    d.close()


def test_fork_close_and_a_reward_of_none(tokenizer):
    Lifecycle.forks = Lifecycle.closes = 0
    d = Driver(tokenizer, ["rollout.environment=test_environments.Lifecycle"])
    assert d.root.opening[-1]["content"].endswith("Move twice.")
    first, _, done = d.reply(d.root, call("move", where="up"))
    a, _, _ = d.reply(first, call("move", where="left"), done, last=False)
    b, _, _ = d.reply(first, call("move", where="right"), done, last=True)
    assert Lifecycle.forks == 1 and a.instance.moves == ["up", "left"] and b.instance.moves == ["up", "right"]
    ended, end, _ = d.reply(a, "stop", ending=True)
    assert end is None and ended.reward is None  # get_reward None: no reward from the environment
    for episode in (ended, b, b):
        d.episodes.close(episode)
    assert Lifecycle.closes == 2  # each instance once
    handle = Driver(tokenizer, ["rollout.environment=test_environments.Handle"])
    with pytest.raises(EpisodeError, match=r"copy.deepcopy raised TypeError.*give the class a fork\(\) method"):
        handle.episodes.branch(handle.root, last=False)
    handle.close()
    d.close()


def test_trl_tool_names_and_callable_attributes(tokenizer):
    d = Driver(tokenizer, ["rollout.environment=test_environments.TRLNames"])
    assert d.play.methods == ["respond"] and not d.play.answers
    _, answer, _ = d.reply(d.root, call("respond", text="hi"))
    assert "HI" in tokenizer.decode(answer)
    _, answer, _ = d.reply(d.root, call("client"))
    assert "Tool client not found" in tokenizer.decode(answer)
    d.close()


def test_async_environments_and_tools_share_the_stages_event_loop(tokenizer):
    LOOPS.clear()
    d = Driver(tokenizer, ["rollout.environment=test_environments.AsyncEnvironment",
                           "rollout.tools=[test_environments.slow_double]"])
    first, answer, done = d.reply(d.root, call("ping"))
    assert "pong" in tokenizer.decode(answer)
    _, answer, _ = d.reply(first, call("slow_double", x=4), done)
    assert "8" in tokenizer.decode(answer) and LOOPS == {id(d.calls.loop)}
    d.close()


def test_a_malformed_call_is_answered_with_an_error_the_model_sees(tokenizer):
    d = Driver(tokenizer, ["rollout.tools=[lsreplay.data.agentic.calculator]"])
    for text in ("<tool_call>{calculator}</tool_call>", '<tool_call>{"name": "calculator"', "<tool_call>[1]</tool_call>"):
        episode, answer, _ = d.reply(d.root, text)
        assert "error" in tokenizer.decode(answer) and episode.tool_errors == 1
    d.close()


def test_a_resumed_stage_reads_the_tools_recorded_answers_and_checks_the_environments(tokenizer):
    """The journal an interrupted stage wrote: a plain tool is not called again (no second side
    effect); the environment's method is, to rebuild its state, and must answer as before."""
    EFFECTS.clear()
    journal = Journal()
    overrides = ["rollout.environment=test_environments.Counter", "rollout.tools=[test_environments.side_effect]"]
    first = Driver(tokenizer, overrides, journal)
    a, _, done = first.reply(first.root, call("side_effect", what="a"))
    b, answer, done = first.reply(a, call("bump", by=2), done)
    first.close()
    assert EFFECTS == ["a"] and len(journal) == 2

    again = Driver(tokenizer, overrides, journal)
    a2, _, done2 = again.reply(again.root, call("side_effect", what="a"))
    b2, answer2, done2 = again.reply(a2, call("bump", by=2), done2)
    assert EFFECTS == ["a"] and answer2 == answer and b2.instance.count == 2 and done2 == done
    again.close()

    key = next(k for k, v in journal.items() if "bump" in str(v))
    journal[key]["tools"][0]["message"]["content"] = "3"  # what another environment answered
    diverged = Driver(tokenizer, overrides, journal)
    a3, _, done3 = diverged.reply(diverged.root, call("side_effect", what="a"))
    with pytest.raises(EpisodeError, match="on resume its tool bump answered '2' .* recorded '3'"):
        diverged.reply(a3, call("bump", by=2), done3)
    diverged.close()


def turns_taken(completions, **kwargs) -> list[float]:
    """A TRL-style reward of multi-turn completions: the assistant messages in each."""
    return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]


def counted(environments, **kwargs) -> list[float]:
    """TRL's reward_func(environments, **kwargs): read each episode's instance."""
    return [float(env.count) for env in environments]


def test_rewards_see_the_episodes_messages_environments_and_the_environments_reward():
    from lsreplay.data.rewards import Reward

    row = Prompt(0, "basic_arithmetic", "What is 3 + 4?", "7", {}, {"answer": "7"})
    messages = [[[{"role": "assistant", "content": "8"}, {"role": "user", "content": "Wrong"},
                  {"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "7"}]]]
    instances = [Counter(), Counter()]
    instances[0].count, instances[1].count = 3, 4
    args = ([row], [["7", "7"]], [[[1, 2], [3]]], None, messages, [[0.5, None]], [instances])
    scored = Reward(load_config(None, ["reward.functions=[test_environments.turns_taken,test_environments.counted]"]
                                )).score(*args)
    assert scored.by_function == {"turns_taken": [[2.0, 1.0]], "counted": [[3.0, 4.0]], "environment": [[0.5, None]]}
    assert scored.totals == [[5.5, 5.0]]
    alone = Reward(load_config(None, [])).score(*args)  # no reward.functions: no default checker beside it
    assert alone.by_function == {"environment": [[0.5, None]]} and alone.totals == [[0.5, None]]


@pytest.mark.parametrize("override, message", [
    ("rollout.tools=[test_environments.untyped]", r"rollout.tools\[0\] = 'test_environments.untyped'"),
    ("rollout.environment=test_environments.Handle", r"Handle: copy.deepcopy raised .* fork\(\) method"),
])
def test_preflight_refuses_a_tool_without_a_schema_or_an_environment_that_cannot_fork(tiny_model_dir, tmp_path,
                                                                                        override, message):
    from lsreplay.stages.preflight import preflight

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "data.size=8",
                             "data.prompts_per_step=2", "drafter.enabled=false", "rollout.max_turns=2", override])
    with pytest.raises(EpisodeError, match=message):
        preflight(cfg)
    assert not (tmp_path / "run" / "step_0000").exists()


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with another chat template."""
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return changed


def test_a_template_that_renders_tools_gets_them_through_tools(tokenizer):
    native = with_template(tokenizer, (
        "{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    d = Driver(native, ["rollout.tools=[lsreplay.data.agentic.calculator]"])
    assert d.episodes.chat.native and not any("<tools>" in m["content"] for m in d.root.opening)
    assert native.decode(d.episodes.prompt_ids()[0]).startswith('<|im_start|>system\n<tools>[{"type": "function"')
    _, answer, _ = d.reply(d.root, call("calculator", expression="2*3"))
    assert native.decode(answer) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
    d.close()


def test_a_template_that_is_not_prefix_preserving_is_refused(tokenizer):
    """A template that shows only the last assistant reply (as some drop earlier reasoning)."""
    dropping = with_template(tokenizer, (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    d = Driver(dropping, ["rollout.environment=lsreplay.data.agentic.ArithmeticFeedback"])
    with pytest.raises(EpisodeError, match="not prefix-preserving"):
        d.reply(d.root, "It is 8")
    d.close()
