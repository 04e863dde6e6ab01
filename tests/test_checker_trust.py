"""Data never reaches an evaluator: reasoning-gym's checkers that evaluate text are listed (and
the list checked against the installed package), a prompt row of a task whose checker evaluates
the row is scored only as lsreplay generated it (a crafted prompt file is refused before any
work, as `lsreplay train` runs it), and those checkers score in a child process where model
text is read, not run, and a checker that overruns is stopped."""

from __future__ import annotations

import inspect
import json
import logging
import re
import sys

import pytest

from lsreplay import cli
from lsreplay.core.config import load_config
from lsreplay.data.checkers import EVALUATES_ANSWER, EVALUATES_ROW, SANDBOXED, check_rows
from lsreplay.data.prompt_sets import prompt_file, source_prompts
from lsreplay.data.rewards import Reward
from lsreplay.data.sources import DatasetError, PromptSet

# Calls that evaluate text as code (sympy's parse_expr and sympify are eval underneath).
EVALUATES = re.compile(r"\b(eval|exec|compile|parse_expr|sympify|parse_latex)\s*\(")


def reached_source(cls, function, seen: set) -> str:
    """The source of `function` and of what it calls of its module's functions and its class's methods."""
    source, module = inspect.getsource(function), sys.modules[function.__module__]
    called = [vars(module).get(n) for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", source)]
    called += [getattr(cls, n, None) for n in re.findall(r"self\.(\w+)\s*\(", source)]
    for f in called:
        if inspect.isfunction(f) and f not in seen and f.__module__.startswith("reasoning_gym"):
            seen.add(f)
            source += reached_source(cls, f, seen)
    return source


def test_every_checker_that_evaluates_text_is_listed():
    """Read from the installed reasoning-gym: a new release's checker that evaluates fails here
    until lsreplay.data.checkers lists it. (composite forwards to the checker its row names.)"""
    from reasoning_gym.factory import DATASETS

    evaluating = {task for task, (cls, _) in DATASETS.items()
                  if EVALUATES.search(reached_source(cls, cls.score_answer, set()))}
    assert evaluating == SANDBOXED - {"composite"}
    assert set(EVALUATES_ROW) | set(EVALUATES_ANSWER) == SANDBOXED


def crafted_prompt_file(path, marker) -> None:
    """The issue's prompt file: a bitwise_arithmetic row whose metadata.problem runs code."""
    problem = f"__import__('os').system('touch {marker}') or 2"
    path.write_text(json.dumps({"question": "What is 1 + 1? Answer in hexadecimal.", "answer": "0x2",
                                "task": "bitwise_arithmetic", "metadata": json.dumps(
                                    {"problem": problem, "source_index": 0})}) + "\n")


def test_a_crafted_prompt_file_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    prompts, marker = tmp_path / "prompts.jsonl", tmp_path / "ran"
    crafted_prompt_file(prompts, marker)
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={prompts}",
                     "steps=1", "drafter.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}: row 0 of task 'bitwise_arithmetic': its checker evaluates the row as code " \
           "(eval(metadata['problem'])), so lsreplay scores it only as it generated it itself" in err, err
    assert "score these rows with reward.functions=[module:function] of your own" in err
    assert not marker.exists() and not (tmp_path / "run" / "config.json").exists()


TASKS = ["bitwise_arithmetic", "number_sorting", "simple_integration", "countdown", "string_insertion", "n_queens"]


@pytest.fixture(scope="module")
def generated():
    """A run's config over every kind of checker that evaluates, and its prompts."""
    cfg = load_config(None, [f"data.tasks={json.dumps(TASKS)}", "data.size=12", "seed=3", "data.task_args={}"])
    return cfg, source_prompts(cfg)


def test_rows_lsreplay_generated_score_in_the_child_and_model_text_runs_nowhere(generated, tmp_path):
    cfg, prompts = generated
    reward, marker = Reward(cfg), tmp_path / "ran"
    reward.checking.child.prepare("lsreplay.data.hardened_checkers:harden")
    started = reward.checking.child.starts
    attacks = [f"<answer>__import__('os').system('touch {marker}')</answer>", "<answer>9**9**9</answer>",
               "<answer>((10**100)**100)**100**100</answer>", "<answer>open('/etc/passwd').read()</answer>"]
    for i in range(len(prompts)):
        prompt = prompts[i]
        totals = reward.score([prompt], [[f"<answer>{prompt.answer}</answer>", *attacks]], [[[]] * 5], None).totals
        assert totals[0][0] == 1.0, (prompt.task, prompt.answer)  # the right answer, checked as reasoning-gym checks
        assert all(t <= 0.01 for t in totals[0][1:]), (prompt.task, totals)  # countdown gives 0.01 for a wrong one
    assert not marker.exists()
    assert reward.checking.child.starts == started  # one child scored them all: none was stopped


def test_a_copy_of_lsreplays_own_file_is_accepted_and_an_edited_one_refused(generated, tmp_path):
    cfg, _ = generated
    rows = [json.loads(line) for line in prompt_file(cfg).read_text().splitlines()]
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_rows(cfg, PromptSet.from_file(copy))  # the rows lsreplay generates from this config
    edited = next(r for r in rows if r["task"] == "bitwise_arithmetic")
    edited["question"] = edited["question"].replace("Please solve", "Kindly solve")
    copy.write_text(json.dumps(edited) + "\n")
    with pytest.raises(DatasetError, match="its question or answer is not the one generated for row 0 of the task"):
        check_rows(cfg, PromptSet.from_file(copy))


def test_a_checker_past_its_time_is_stopped_and_the_answer_scores_0(generated, caplog):
    """An answer whose check takes sympy about 0.3 s, against sandbox.checker_seconds=0.2: the
    child is killed and the answer scores 0; the next answer is scored by a new child."""
    cfg, prompts = generated
    cfg = load_config(None, [f"data.tasks={json.dumps(TASKS)}", "data.size=12", "seed=3", "data.task_args={}",
                             "sandbox.checker_seconds=0.2"])
    reward = Reward(cfg)
    integration = next(prompts[i] for i in range(len(prompts)) if prompts[i].task == "simple_integration")
    checking = reward.checking.child
    checking.prepare("lsreplay.data.hardened_checkers:harden")
    started = checking.starts
    slow = "<answer>(x + 1)**60*(x + 2)**60*(x + 3)**60</answer>"
    with caplog.at_level(logging.WARNING, logger="lsreplay"):
        totals = reward.score([integration], [[slow, f"<answer>{integration.answer}</answer>"]], [[[], []]],
                              None).totals
    assert totals == [[0.0, 1.0]]
    assert "the checker of simple_integration did not score an answer of prompt" in caplog.text
    assert "did not return within 0.2 s in the reasoning-gym child process (killed)" in caplog.text
    assert checking.starts == started + 1  # killed on the first answer, started again for the second
