"""Tests for lsreplay.data.sources: prompt generation, loading, sampling and rewards."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lsreplay.data.rewards import extract_answer, score
from lsreplay.data.sources import DatasetError, Prompt, PromptSet, generate_prompt_file

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


def test_exact_answer_rows_are_scored_by_exact_match_without_reasoning_gym(tmp_path):
    """A prompt file of exact_answer rows loads, samples and scores with reasoning-gym
    unimportable (a machine without it, e.g. the GPU check's: bench/gpu_smoke.py)."""
    path = tmp_path / "own.jsonl"
    path.write_text(json.dumps({"question": "What is 3 + 4?", "answer": "7", "task": "exact_answer"}) + "\n")
    script = f"""
import sys
sys.modules["reasoning_gym"] = None  # any import of it fails
from lsreplay.data.rewards import score
from lsreplay.data.sources import PromptSet
p = PromptSet.from_file({str(path)!r}).sample(0, 1, 0)[0]
print(score(p, "so <answer> 7 </answer>"), score(p, "<answer>8</answer>"), score(p, "it is 7"), score(p, "no idea"))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1.0", "0.0", "1.0", "0.0"]


def _without_reasoning_gym(monkeypatch) -> None:
    """Every import of reasoning-gym fails from here, as on a machine without it."""
    for name in ["reasoning_gym", *(n for n in sys.modules if n.startswith("reasoning_gym."))]:
        monkeypatch.setitem(sys.modules, name, None)


def test_preflight_of_exact_answer_prompts_needs_no_reasoning_gym(tmp_path, tiny_model_dir, monkeypatch):
    """preflight checks that the default reward can score every task; a file of exact_answer
    rows asks nothing of reasoning-gym (bench/gpu_smoke.py's flow, on a machine without it).
    A task that does need it says what to install, before any work."""
    from lsreplay.core.config import load_config
    from lsreplay.stages.preflight import preflight

    rows = [{"question": f"What is {a} + 4?", "answer": str(a + 4), "task": "exact_answer"} for a in range(4)]
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={path}",
                 "data.prompts_per_step=2"]
    _without_reasoning_gym(monkeypatch)
    assert preflight(load_config(None, overrides)).cfg.data.path == str(path)
    path.write_text(path.read_text() + json.dumps({"question": "q", "answer": "1", "task": "chain_sum"}) + "\n")
    with pytest.raises(DatasetError, match=r"reasoning-gym is not importable.*pip install reasoning-gym"):
        preflight(load_config(None, overrides))


def test_score_gsm_symbolic(prompt_file):
    p = _first(prompt_file, "gsm_symbolic")
    assert score(p, f"<answer>{p.answer}</answer>") == 1.0


def test_extract_answer():
    assert extract_answer("<answer>1</answer> then <answer> 42 </answer>") == "42"
    assert extract_answer("<answer></answer> 5 - 3 = 2") == "2"
    assert extract_answer("x = 3-4 = -1.5") == "-1.5"
    assert extract_answer("total 1,234 apples") == "1234"
    assert extract_answer("no digits here") is None


def test_task_args_of_tasks_not_generated_are_ignored(tmp_path):
    """A default keyed to basic_arithmetic must not stop a run of other tasks; a name that
    is no reasoning-gym task at all is still a typo."""
    path = generate_prompt_file(tmp_path / "p.jsonl", ["chain_sum"], 4, 0, {"basic_arithmetic": {"min_terms": 2}})
    assert {json.loads(line)["task"] for line in path.read_text().splitlines()} == {"chain_sum"}
    with pytest.raises(DatasetError, match="data.task_args: unknown task 'chain_summ': neither lsreplay's"):
        generate_prompt_file(tmp_path / "q.jsonl", ["chain_sum"], 4, 0, {"chain_summ": {}})


def _own_rows(n: int = 6) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "solution": 2 * i, "difficulty": i % 3} for i in range(n)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk", "save_to_disk-dict"])
def test_own_data_in_any_format_with_named_columns(kind, tmp_path):
    """JSONL, Parquet or a save_to_disk folder (a Dataset, or a DatasetDict split), columns
    named by data.columns; the other columns reach the reward function through metadata."""
    import datasets

    table = datasets.Dataset.from_list(_own_rows())
    path = tmp_path / "own"
    if kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in _own_rows()))
    elif kind == "parquet":
        path = path.with_suffix(".parquet")
        table.to_parquet(str(path))
    elif kind == "save_to_disk":
        table.save_to_disk(str(path))
    else:
        datasets.DatasetDict({"train": table.select(range(2)), "test": table}).save_to_disk(str(path))
    columns = {"question": "prompt", "answer": "solution", "task": "task"}
    prompts = PromptSet.from_file(path, columns=columns, required=("question", "answer"), split="test")
    assert len(prompts) == 6
    p = prompts[3]
    assert (p.index, p.question, p.answer, p.task, p.metadata) == (3, "What is 3 + 3?", "6", "", {"difficulty": 0})


def test_missing_split_and_unmapped_column_say_what_to_set(tmp_path):
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_list(_own_rows())}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(DatasetError, match=r"no split 'train'; it holds \['validation'\]: set data.split"):
        PromptSet.from_file(tmp_path / "d")
    # The prompt column (TRL's name) is found; the reference answer is not.
    with pytest.raises(DatasetError, match="required field 'answer' is missing .column 'answer'.*"
                                           "data.columns.answer=NAME"):
        PromptSet.from_file(tmp_path / "d", split="validation")
    rows = [{"text": r["prompt"], "answer": r["solution"], "task": "exact_answer"} for r in _own_rows()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "e"))
    with pytest.raises(DatasetError, match="required field 'question' is missing .column 'question'.*"
                                           "data.columns.prompt=NAME"):
        PromptSet.from_file(tmp_path / "e")


def test_a_hub_dataset_name_says_how_to_save_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=r"openai/gsm8k: no such file or folder here; a dataset name on the Hugging "
                                           r"Face Hub is not read, because nothing is downloaded at run time. Save it "
                                           r"to disk once, .*load_dataset\('openai/gsm8k'\).save_to_disk\('gsm8k'\)"
                                           r".*data.path=gsm8k"):
        PromptSet.from_file("openai/gsm8k")
    with pytest.raises(DatasetError, match="prompt file not found"):  # a file's name is no Hub name
        PromptSet.from_file("data/train.jsonl")


def test_eval_split_reads_a_datasetdicts_test_split_and_only_that(tmp_path):
    import datasets

    from lsreplay.core.config import load_config
    from lsreplay.data.prompt_sets import heldout_prompts, training_prompts

    rows = _own_rows()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "d"))
    base = [f"data.path={tmp_path / 'd'}", "data.columns.answer=solution", "reward.function=m:f", "eval.every=1",
            "eval.size=2", "data.prompts_per_step=2"]
    cfg = load_config(None, [*base, "eval.split=test"])
    assert heldout_prompts(cfg).column("question") == [r["prompt"] for r in rows[4:6]]
    assert training_prompts(cfg).column("question") == [r["prompt"] for r in rows[:4]]  # all of train
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match="eval.split='test' names a split of a folder datasets' save_to_disk wrote"):
        heldout_prompts(load_config(None, [*base[1:], f"data.path={tmp_path / 'train.jsonl'}", "eval.split=test"]))


def test_select_keeps_the_file_row_numbers(prompt_file):
    prompts = PromptSet.from_file(prompt_file).select([3, 7, 11])
    assert [prompts[i].index for i in range(3)] == [3, 7, 11]
    assert prompts.column("question") == [PromptSet.from_file(prompt_file)[i].question for i in (3, 7, 11)]
    assert {p.index for p in prompts.sample(step=0, batch_size=3, seed=0)} == {3, 7, 11}
