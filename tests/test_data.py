"""Tests for lsreplay.data: prompt generation, loading, sampling and rewards."""

import json

import pytest

from lsreplay.data import DatasetError, Prompt, PromptSet, generate_prompt_file
from lsreplay.rewards import extract_answer, score

TASKS = ["basic_arithmetic", "gsm_symbolic"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    return generate_prompt_file(path, TASKS, size=20, seed=3)


def test_generated_file_loads_with_all_fields(prompt_file):
    prompts = PromptSet.from_file(prompt_file)
    assert len(prompts) == 20
    assert {p.task for p in (prompts[i] for i in range(20))} == set(TASKS)
    for i in range(len(prompts)):
        p = prompts[i]
        assert p.index == i and p.question and p.answer and isinstance(p.metadata, dict)
    with pytest.raises(IndexError):
        prompts[20]


def test_generation_is_idempotent_and_seeded(prompt_file, tmp_path):
    before = prompt_file.stat().st_mtime_ns
    generate_prompt_file(prompt_file, TASKS, size=20, seed=3)
    assert prompt_file.stat().st_mtime_ns == before
    again = generate_prompt_file(tmp_path / "again.jsonl", TASKS, size=20, seed=3)
    assert again.read_text() == prompt_file.read_text()
    other = generate_prompt_file(tmp_path / "other.jsonl", TASKS, size=20, seed=4)
    assert other.read_text() != prompt_file.read_text()


def test_changed_request_regenerates(tmp_path):
    path = generate_prompt_file(tmp_path / "p.jsonl", ["basic_arithmetic"], size=4, seed=0)
    generate_prompt_file(path, ["basic_arithmetic"], size=6, seed=0)
    assert len(path.read_text().splitlines()) == 6


def test_unknown_task_names_valid_ones(tmp_path):
    with pytest.raises(DatasetError, match="basic_arithmetic"):
        generate_prompt_file(tmp_path / "p.jsonl", ["basic_arithmetc"], size=4, seed=0)


def test_bad_task_args_are_reported(tmp_path):
    with pytest.raises(DatasetError, match="max_digits"):
        generate_prompt_file(
            tmp_path / "p.jsonl", ["basic_arithmetic"], 4, 0, {"basic_arithmetic": {"digits": 1}}
        )


def test_sample_is_deterministic_per_seed_and_step(prompt_file):
    prompts = PromptSet.from_file(prompt_file)
    first = [p.index for p in prompts.sample(step=0, batch_size=8, seed=1)]
    assert first == [p.index for p in prompts.sample(step=0, batch_size=8, seed=1)]
    assert len(set(first)) == 8  # without replacement
    assert first != [p.index for p in prompts.sample(step=1, batch_size=8, seed=1)]
    assert first != [p.index for p in prompts.sample(step=0, batch_size=8, seed=2)]
    assert len(prompts.sample(step=0, batch_size=50, seed=1)) == 50  # with replacement


def test_missing_field_names_field_and_file(tmp_path):
    path = tmp_path / "no_answer.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "task": "basic_arithmetic"}) + "\n")
    with pytest.raises(DatasetError) as err:
        PromptSet.from_file(path)
    assert "answer" in str(err.value) and str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        PromptSet.from_file(tmp_path / "absent.jsonl")


def test_metadata_is_optional(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "2", "task": "basic_arithmetic"}) + "\n")
    assert PromptSet.from_file(path)[0].metadata == {}


def _first(prompt_file, task: str) -> Prompt:
    prompts = PromptSet.from_file(prompt_file)
    return next(p for p in (prompts[i] for i in range(len(prompts))) if p.task == task)


def test_score_uses_the_task_checker(prompt_file):
    p = _first(prompt_file, "basic_arithmetic")
    wrong = str(int(p.answer) + 1)
    assert score(p, f"Let me think.\n<answer>{p.answer}</answer>") == 1.0
    assert score(p, f"<answer>{wrong}</answer>") < 1.0
    assert score(p, f"Adding it up, so the result is {p.answer}.") == 1.0
    assert score(p, "I do not know.") == 0.0


def test_score_gsm_symbolic(prompt_file):
    p = _first(prompt_file, "gsm_symbolic")
    assert score(p, f"<answer>{p.answer}</answer>") == 1.0


def test_extract_answer():
    assert extract_answer("<answer>1</answer> then <answer> 42 </answer>") == "42"
    assert extract_answer("<answer></answer> 5 - 3 = 2") == "2"
    assert extract_answer("x = 3-4 = -1.5") == "-1.5"
    assert extract_answer("total 1,234 apples") == "1234"
    assert extract_answer("no digits here") is None
