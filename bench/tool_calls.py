"""The tool calls a model makes in a config's episodes: one rollout stage, no training.

    .venv/bin/python bench/tool_calls.py [--config CONFIG] [--prompts 4] [key=value ...]

Samples step 0's episodes of CONFIG (default configs/agentic-tool.yaml, the tool task of
bench/agentic.py) for the first --prompts prompts the run draws, with the trees stage as a
run samples them, in a run directory of its own that it deletes afterwards, and prints the
step's episode figures as key=value (each episode counted as the samples it stands for):
episodes/tool_calls_mean (calls run per episode), episodes/tool_error_share (of those, the
failed ones), episodes/turns_mean, episodes/environment_token_share, reward_mean, and the
seconds the trees stage took. A quick
check that a prompt makes the model use its tools, before a training run or a benchmark.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lsreplay import stages  # noqa: E402
from lsreplay.core.config import load_config  # noqa: E402
from lsreplay.stages.preflight import preflight  # noqa: E402
from side_by_side import key_values  # noqa: E402

FIGURES = ("episodes/tool_calls_mean", "episodes/tool_error_share", "episodes/turns_mean",
           "episodes/environment_token_share", "reward_mean")


def rollout_stage(config: str, prompts: int, overrides: list[str]) -> tuple[dict, float]:
    """Step 0's trees stage of `config` for its first `prompts` prompts, in a run directory of
    its own (deleted after): the stage's manifest, and the seconds it took."""
    with tempfile.TemporaryDirectory(prefix="lsreplay-rollouts-") as folder:
        cfg = load_config(config, [*overrides, f"run_dir={folder}/run", "steps=1",
                                   f"data.prompts_per_step={prompts}", "eval.every=0"])
        run = preflight(cfg)
        stages.sample_prompts(run, 0)
        started = time.perf_counter()
        trees = stages.generate_trees(run, 0)
        return trees, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs/agentic-tool.yaml"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="key=value applied to the config")
    args = parser.parse_args(argv)
    trees, seconds = rollout_stage(args.config, args.prompts, args.overrides)
    print(key_values({**{k: trees[k] for k in FIGURES}, "leaves": trees["rollouts"], "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
