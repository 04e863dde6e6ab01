"""The `lsreplay` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _train(args) -> int:
    # Library logs (lsreplay.*) show in the terminal and in the Prefect UI next to the
    # task logs; must be set before Prefect configures logging on import.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lsreplay")
    from lsreplay.config import load_config

    load_config(args.config, args.overrides)  # fail on a bad config before Prefect starts
    from flows.train import train

    metrics = train(config_path=args.config, overrides=args.overrides, force=args.force)
    print(f"finished {len(metrics)} steps; metrics in the run directory's metrics.jsonl")
    return 0


def _convert(args) -> int:
    from lsreplay.models import convert_smollm2

    print(convert_smollm2(args.cache_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lsreplay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run or resume RL training (a Prefect flow)")
    train.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=2 rollout.branching=[4,2]")
    train.add_argument("--force", action="store_true", help="resume even if result-affecting config keys changed")
    train.set_defaults(fn=_train)
    convert = sub.add_parser("convert-model", help="convert the shipped SmolLM2 GGUF to an HF folder (once)")
    convert.add_argument("--cache-dir", default=".cache/models")
    convert.set_defaults(fn=_convert)
    args = parser.parse_args(argv)
    if args.command == "train" and args.config and "=" in args.config:
        args.overrides.insert(0, args.config)  # `lsreplay train steps=2`: no config file given
        args.config = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    from lsreplay.config import ConfigError
    from lsreplay.data import DatasetError
    from lsreplay.models import ModelError

    try:
        return args.fn(args)
    except (ConfigError, DatasetError, ModelError) as e:
        print(f"lsreplay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
