"""Absurd sizes are refused up front, with the figure, the key and the limit to raise (limits.*),
a context beyond the model's positions before any work, and a rewind visits only the steps the
store holds, however many the run has."""

from __future__ import annotations

import pytest

from lsreplay import cli
from lsreplay.core.config import ConfigError, load_config
from lsreplay.core.run import Run
from lsreplay.core.storage import Store
from lsreplay.state import checkpointing


@pytest.mark.parametrize("overrides, message", [
    (["steps=1000000000"], "config key 'steps' = 1000000000 is not allowed: at most limits.steps = 100000; raise "
                           "limits.steps if the run truly needs more"),
    (["rollout.branching=[1000,1000]"], "config key 'rollout.branching' = [1000, 1000] is not allowed: 1000000 "
                                        "rollouts per prompt (the product of the fan-outs), more than "
                                        "limits.rollouts_per_prompt = 1024"),
    (["data.prompts_per_step=512", "data.size=512", "rollout.branching=[256]", "rollout.segment_tokens=[]"],
     "config key 'data.prompts_per_step' = 512 is not allowed: 131072 rollouts a step (data.prompts_per_step x 256 "
     "rollouts per prompt), more than limits.rollouts_per_step = 65536"),
    (["algo.dynamic_sampling=true", "algo.dynamic_sampling_draws=100", "data.prompts_per_step=128", "data.size=128",
      "rollout.branching=[8]", "rollout.segment_tokens=[]"],
     "102400 rollouts a step (data.prompts_per_step x 8 rollouts per prompt x 100 draws)"),
    (["rollout.max_turns=10000"], "config key 'rollout.max_turns' = 10000 is not allowed: at most limits.turns = 256 "
                                  "turns an episode"),
])
def test_absurd_sizes_are_refused_with_the_figure_and_the_key(overrides, message):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    assert message in str(refused.value)


def test_a_raised_limit_lets_a_size_through():
    assert load_config(None, ["steps=200000", "limits.steps=200000"]).steps == 200000
    assert load_config(None, ["rollout.branching=[64,32]", "limits.rollouts_per_prompt=2048",
                              "rollout.segment_tokens=[4]"]).rollout.branching == [64, 32]


def test_a_context_beyond_the_models_positions_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    """The tiny model has 2048 positions: a prompt of 256 tokens and answers of 2000 do not fit."""
    run_dir = tmp_path / "run"
    assert cli.main(["train", f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "data.size=8",
                     "rollout.max_new_tokens=2000", "drafter.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "the run needs 2256 positions (data.max_prompt_tokens=256 + 2000 completion tokens) but " \
           f"{tiny_model_dir} reaches 2048 (max_position_embeddings)" in err, err
    assert not (run_dir / "config.json").exists()  # nothing of the run was written


class CountingStore(Store):
    """A local store that counts what is read and listed (a rewind's cost in store calls)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.calls = 0

    def read_bytes(self, key: str, sha256: str | None = None) -> bytes:
        self.calls += 1
        return super().read_bytes(key, sha256)

    def list(self, prefix: str = "") -> list[str]:
        self.calls += 1
        return super().list(prefix)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        self.calls += 1
        return super().sizes(prefix)


def test_a_rewind_visits_only_the_steps_the_store_holds(tmp_path):
    """A run of limits.steps steps whose store holds two: the rewind forgets step 1's update
    (no checkpoint after step 0's) with a handful of store calls, not one per step."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "steps=100000"])
    store = CountingStore(str(tmp_path / "run"))
    run = Run(cfg, store)
    for step in (0, 1):
        run.finish(step, "prompts", {"files": []})
        run.finish(step, "policy", {"files": []})
    store.calls = 0
    assert checkpointing.rewind(run) == 0
    assert run.done(0, "prompts") and run.done(1, "prompts")  # rollouts and prompts stand
    assert run.done(0, "policy") is None and run.done(1, "policy") is None  # no committed checkpoint: recomputed
    assert store.calls < 20, store.calls  # before: about 4 per step of the run's 100,000
