"""What one replay run costs beyond its positions: the figure behind memory.RUN_POSITIONS.

    .venv/bin/python bench/run_cost.py [--config configs/default.yaml] [--lengths 8,16,32,64,128] [--rounds 4] [key=value ...]

Replay runs the leaves of a tree in micro-batches and every kept node's backward on its
own, each a forward and backward that ends in every weight's gradient. memory.kept_spans
trades a run against the memory a kept node frees by running some of its layers again;
it prices a run at RUN_POSITIONS positions' forward and backward. This times runs of one
sequence of each length as replay runs a leaf: forward_segments with grad, every position
scored by the logprob head, the backward into the weights' summed buffers
(models/summed_grads.py, entered once around all runs as replay_backward does), on the
config's policy at its thread count. The lengths alternate in order over --rounds after a
warm-up round (side_by_side.alternating); the minimum per length is fitted by least squares:

    seconds(L) = fixed_seconds + L * per_position_seconds

The last line is key=value pairs: fixed_seconds, per_position_ms, fixed_positions (the
fixed cost in positions: what RUN_POSITIONS should be) and run_positions (the constant).
Run it alone: another job on the machine weighs on the short runs and the long unequally.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lsreplay.core.config import load_config  # noqa: E402
from lsreplay.models.summed_grads import summed_in_place  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.replay.heads import LogprobHead  # noqa: E402
from lsreplay.replay.memory import RUN_POSITIONS  # noqa: E402
from lsreplay.replay.segments import forward_segments  # noqa: E402
from lsreplay.state.resident import policy_model  # noqa: E402
from side_by_side import alternating, key_values  # noqa: E402


def leaf_run(model, tokens: list[int]) -> None:
    """One run as replay runs a leaf of len(tokens) positions, each but the last scored on
    the token after it."""
    hidden, _ = forward_segments(model, [tokens], 0, None)
    at = list(range(len(tokens) - 1))
    LogprobHead(RAW)(model, hidden[0], at, tokens[1:]).sum().backward()


def run_seconds(model, lengths: list[int], rounds: int, seed: int) -> dict[int, float]:
    """The fastest run of each length over `rounds` (side_by_side.alternating: the order
    reversed every round, after a warm-up round), all in one summed_in_place as in replay."""
    generator = torch.Generator().manual_seed(seed)
    tokens = {n: torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths}
    with summed_in_place(model):
        seconds = alternating({n: lambda n=n: leaf_run(model, tokens[n]) for n in lengths}, rounds,
                              torch.device("cpu"))
    return {n: min(s) for n, s in seconds.items()}


def fit(seconds: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds against length."""
    xs, ys = list(seconds), list(seconds.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    parser.add_argument("--lengths", default="8,16,32,64,128",
                        help="run lengths (short enough that attention stays linear in them)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = policy_model(cfg, "cpu")
    seconds = run_seconds(model, [int(n) for n in args.lengths.split(",")], args.rounds, cfg.seed)
    fixed, per_position = fit(seconds)
    print("run of L positions (s): " + ", ".join(f"L={n} {s:.3f}" for n, s in seconds.items()))
    print(key_values({"fixed_seconds": fixed, "per_position_ms": per_position * 1e3,
                      "fixed_positions": fixed / per_position, "run_positions": RUN_POSITIONS,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
