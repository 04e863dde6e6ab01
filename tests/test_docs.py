"""README.md and docs/*.md name only config keys, flags, files, tests, modules and make targets
that exist (tests/docs_check.py, `make docs-check`)."""

from __future__ import annotations

from docs_check import problems


def test_the_docs_name_only_what_exists():
    assert problems() == []


def test_a_page_naming_what_does_not_exist_is_answered_line_by_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "`rollout.branching`, `model.lora.rank`, `model.arch.hidden_size` and `algo.name=ppo` are keys;",
        "`rollout.branchings` is none, nor `algo.nme=ppo`; `checkpoint.json` is a file.",
        "    lsreplay train configs/default.yaml pool.slotz=2 --force --steps 2 --num_generations 8",
        "`lsreplay resume RUN --from-stepp 3`; `pytest --durations=15` is pytest's.",
        "`lsreplay/core/config/loading.py`, `tests/test_config.py::test_every_alias_points_at_a_real_key`,",
        "`lsreplay/core/config.py`, `test_config.py::test_no_such_test`, `flows/train.py:train`,",
        "`lsreplay.core.deadline.stage_deadline`, `lsreplay.core.deadline.no_such_name`, `lsreplay.core.nowhere`,",
        "[fine](http://example.com), [gone](nowhere.md#a), `make run`, `make docs-check`, `make tests`.",
    ]))
    found = problems([page])
    assert found == [
        f"{page}:2: config key 'rollout.branchings' does not exist",
        f"{page}:2: config key 'algo.nme' does not exist",
        f"{page}:3: config key 'pool.slotz' does not exist",
        f"{page}:4: command-line flag '--from-stepp' is no flag of lsreplay's",
        f"{page}:6: file 'lsreplay/core/config.py' does not exist",
        f"{page}:6: test tests/test_config.py::test_no_such_test does not exist",
        f"{page}:7: lsreplay.core.deadline defines no 'no_such_name' (named as 'lsreplay.core.deadline.no_such_name')",
        f"{page}:7: lsreplay.core defines no 'nowhere' (named as 'lsreplay.core.nowhere')",
        f"{page}:8: the Makefile has no target 'tests'",
        f"{page}:8: link to 'nowhere.md': no such file",
    ], found
