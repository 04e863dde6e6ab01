"""Untrusted computation is bounded and killable: a child process with CPU, memory and wall
limits that this one kills (lsreplay.core.sandbox), the built-in calculator sizing every number
before it makes it, and reward functions and tools marked untrusted running in such a child,
as they would here, the expressions of the issue ended within their timeouts."""

from __future__ import annotations

import json
import sys
import time

import pytest
from transformers import TrainerState

from lsreplay.core.config import load_config
from lsreplay.core.sandbox import Child, Limits, Overrun, SandboxError, close_children
from lsreplay.data.agentic import calculator
from lsreplay.data.environments import Calls, call_tool, load_play
from lsreplay.data.expressions import TooLarge, arithmetic, check_symbolic
from lsreplay.data.rewards import Reward, RewardError
from lsreplay.data.sources import Prompt

LIMITS = Limits(cpu_seconds=2, memory_bytes=2**30)
# The expressions: 0.17 s, then minutes of one `**` holding the interpreter.
FAST, STALLING = "((10**100)**100)**100", "(((10**100)**100)**100)**100"


@pytest.fixture
def sandbox():
    child = Child("test", LIMITS)
    yield child
    child.close()


def test_a_call_past_its_wall_time_is_killed_and_the_next_one_gets_a_new_child(sandbox):
    assert sandbox.call("math:sqrt", 16.0) == 4.0
    start = time.monotonic()
    with pytest.raises(Overrun, match=r"builtins:pow did not return within 1 s in the test child process \(killed\)"):
        sandbox.call("builtins:pow", 10, 10**9, seconds=1)
    assert time.monotonic() - start < 10
    assert sandbox.call("math:sqrt", 25.0) == 5.0 and sandbox.starts == 2


def test_cpu_and_memory_are_limited(sandbox):
    with pytest.raises(SandboxError, match="the test child process used up its 2 CPU seconds"):
        sandbox.call("builtins:pow", 10, 10**9)  # no wall limit: the kernel stops it
    with pytest.raises(SandboxError, match="builtins:bytearray raised MemoryError"):
        sandbox.call("builtins:bytearray", 2**31)  # beyond its 1 GiB of address space
    assert sandbox.call("math:sqrt", 9.0) == 3.0


def test_the_child_answers_json_and_holds_no_credential(sandbox, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-child")
    monkeypatch.setenv("LSREPLAY_PLAIN", "seen")
    sandbox.close()  # started again with this environment
    assert sandbox.call("os:getenv", "AWS_SECRET_ACCESS_KEY") is None
    assert sandbox.call("os:getenv", "LSREPLAY_PLAIN") == "seen"
    with pytest.raises(SandboxError, match="builtins:object raised TypeError: Object of type object is not JSON"):
        sandbox.call("builtins:object")
    with pytest.raises(SandboxError, match="answered more than"):
        sandbox.call("operator:mul", "x", 70 * 2**20)  # an answer of 70 MiB: refused, the child killed


@pytest.mark.parametrize("text", [FAST, STALLING, "9**9**9", "2**10**10", "7 * 10**3000 * 10**3000"])
def test_the_calculator_sizes_numbers_before_making_them(text):
    start = time.monotonic()
    with pytest.raises(TooLarge, match="would have about"):
        calculator(text)
    assert time.monotonic() - start < 0.1
    assert calculator("(3 + 4) * 5") == "35" and calculator("2**-1000") == str(2**-1000)
    assert calculator("10**3000 // 10**2999") == "10"


def test_sympy_is_given_only_bounded_arithmetic_and_elementary_functions():
    check_symbolic("-5*x**9/3 + sin(x)*exp(2*x) + C")
    for refused in ["__import__('os').system('id')", "x.__class__", "preview(x)", "lambda: 1", "'text'", "x[0]",
                    "factorial(10**6)", "_x"]:
        with pytest.raises(ValueError):
            check_symbolic(refused)
    for too_large in ["9**9**9", "(x + 1)**1000", "(10**5000/3)**1000", "2**-100000"]:
        with pytest.raises(TooLarge):
            check_symbolic(too_large)
    assert arithmetic("0x10 << 4", shifts=True) == 256  # bitwise_arithmetic's problems
    with pytest.raises(TooLarge):
        arithmetic("1 << 10**9", shifts=True)


TOOLS = '''
def power(base: int, exponent: int) -> str:
    """Raise a number to a power.

    Args:
        base: the base
        exponent: the exponent
    """
    return str(base ** exponent)[-12:]


def evaluate(expression: str) -> str:
    """Evaluate an expression as Python does.

    Args:
        expression: the expression
    """
    return str(eval(expression))[-12:]


def trl_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("global_step", float(trainer_state.global_step))
    log_extra("length", [len(c) for c in completions])
    return [float(len(c)) for c in completions]


async def async_reward(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "exact": True}


def stalling_reward(prompt, completion):
    return float(len(str(eval(completion))))
'''


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "their_code.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)  # a module next to the config imports, in the child too
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    sys.modules.pop("their_code", None)
    yield
    sys.modules.pop("their_code", None)
    close_children()  # they loaded this test's module from this test's folder


def test_untrusted_tools_run_in_a_child_and_the_stalling_one_ends_at_its_timeout(user_code):
    cfg = load_config(None, ["rollout.tools=[their_code:power,their_code:evaluate]", "rollout.untrusted_tools=true",
                             "rollout.max_turns=2", "rollout.tool_timeout_seconds=3"])
    play = load_play(cfg.rollout, cfg.sandbox)
    assert "their_code" not in sys.modules  # imported in the child only
    assert [s["function"]["name"] for s in play.schemas] == ["power", "evaluate"]
    assert play.schemas[0]["function"]["parameters"]["properties"]["base"] == {"type": "integer",
                                                                               "description": "the base"}

    def call(name: str, **arguments) -> tuple[str, float]:
        play.functions[name].start()  # a killed child starts again before the call's clock does
        start = time.monotonic()
        with Calls(play.timeout) as calls:
            answer = call_tool(play.functions, {"function": {"name": name, "arguments": arguments}}, calls)
        return answer.message["content"], time.monotonic() - start

    assert call("power", base=2, exponent=10)[0] == "1024"
    assert call("evaluate", expression="2**100")[0] == str(2**100)[-12:]
    for name, arguments in (("evaluate", {"expression": STALLING}), ("power", {"base": 10, "exponent": 10**9})):
        content, seconds = call(name, **arguments)
        assert content == f"{{'error': 'Tool {name} did not answer within 3 s.'}}" and seconds < 8, (content, seconds)
    assert call("power", base=3, exponent=3)[0] == "27"  # a new child answers the next call


def test_untrusted_reward_functions_score_as_they_would_here(user_code):
    prompt = Prompt(0, "", "What is 2 + 2?", "4", {}, {"data_source": "arith", "answer": "4"})
    completions, state = [["4", " 5"]], TrainerState(global_step=3)
    functions = "reward.functions=[their_code:trl_reward,their_code:async_reward,their_code:verl_reward]"
    here = Reward(load_config(None, [functions, "data.path=p.jsonl"])).score([prompt], completions, [[[1], [2]]], state)
    sys.modules.pop("their_code", None)
    reward = Reward(load_config(None, [functions, "data.path=p.jsonl", "reward.untrusted=true"]))
    assert "their_code" not in sys.modules
    assert [(f.name, f.style) for f in reward.functions] == [("trl_reward", "trl"), ("async_reward", "trl"),
                                                             ("verl_reward", "verl")]
    there = reward.score([prompt], completions, [[[1], [2]]], state)
    assert json.dumps(there.__dict__, sort_keys=True) == json.dumps(here.__dict__, sort_keys=True)
    assert there.metrics == {"global_step": [3.0]} and there.extras["length"] == [[1, 2]]


def test_an_untrusted_reward_function_that_stalls_stops_the_run_in_its_time(user_code):
    reward = Reward(load_config(None, ["reward.functions=[their_code:stalling_reward]", "data.path=p.jsonl",
                                       "reward.untrusted=true", "reward.timeout_seconds=3"]))
    prompt = Prompt(0, "", "q", "1", {})
    start = time.monotonic()
    with pytest.raises(RewardError, match="did not score the completions of prompts .0. within reward.timeout_"):
        reward.score([prompt], [[STALLING]], [[[]]], None)
    assert time.monotonic() - start < 8
    assert reward.score([prompt], [["2**100"]], [[[]]], None).totals == [[31.0]]


def test_a_closed_child_forgets_the_tools_of_the_run_before(user_code, tmp_path, monkeypatch):
    """One process, two runs: the second's tools load in a fresh child, not after the first
    run's (whose module may no longer import), and a function kept across the close loads
    itself again at its next call."""
    cfg = load_config(None, ["rollout.tools=[their_code:power]", "rollout.untrusted_tools=true"])
    first = load_play(cfg.rollout, cfg.sandbox)
    close_children()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "other_tools.py").write_text("def double(x: int) -> int:\n    \"\"\"Twice x.\n\n    Args:\n"
                                               "        x: a number\n    \"\"\"\n    return 2 * x\n")
    (tmp_path / "their_code.py").unlink()  # the first run's module is gone
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PYTHONPATH", f"{elsewhere}:{':'.join(sys.path)}")
    second = load_play(load_config(None, ["rollout.tools=[other_tools:double]", "rollout.untrusted_tools=true"]).rollout,
                       cfg.sandbox)
    assert second.functions["double"](x=21) == "42"  # a tool answers text
    with pytest.raises(SandboxError, match="their_code"):
        first.functions["power"](base=2, exponent=3)  # loads itself again: its module is gone
