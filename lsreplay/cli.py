"""The `lsreplay` command.

    lsreplay train [CONFIG.yaml] [key=value ...] [--force] [--wait]   run, or resume the run in run_dir
    lsreplay resume RUN_DIR [key=value ...] [--steps N] [--from-step S] [--force] [--wait]
                                                                       continue a run from its saved config
    lsreplay export RUN_DIR OUT [--step N] [--adapters] [key=value ...]
                                                                       a policy checkpoint as an HF model folder
                                                                       (LoRA merged in), or its PEFT adapters
    lsreplay serve [CONFIG.yaml] [key=value ...] (--cron EXPR | --interval SECONDS) [--name NAME]
    lsreplay convert-model                                             the SmolLM2 conversion alone
    lsreplay config [CONFIG.yaml] [key=value ...] [--check]            print the resolved config, validated

Exit status: 0 done, 1 a stage failed (the message names it), 2 bad input (config, model,
data, storage, checkpoint, an entry of the run that is not what lsreplay writes), another
process running the run (without --wait), or no Prefect server to run on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import yaml

# Credentials given as overrides travel by environment, never as flow parameters (which
# the Prefect server stores and shows): the credential keys always, and a URL key's whole
# value when it carries credentials. lsreplay reads each variable where the key is empty.
SECRET_ENV = {"storage.key": "AWS_ACCESS_KEY_ID", "storage.secret": "AWS_SECRET_ACCESS_KEY"}
CREDENTIAL_URL_ENV = {"storage.endpoint_url": "AWS_ENDPOINT_URL_S3", "tracking.mlflow_uri": "MLFLOW_TRACKING_URI"}


def secrets_to_env(overrides: list[str]) -> list[str]:
    """Move every credential of the overrides into its environment variable, whatever the
    spelling (storage.secret=, Hydra's +storage.secret= and ++storage.secret=, or inside a
    section given whole: storage={key: ..., secret: ...}); return the overrides without them."""
    kept = []
    for item in overrides:
        key, equals, value = item.partition("=")
        name = key.strip().lstrip("+")  # Hydra's add (+key=) and force-add (++key=)
        if equals and name in ("storage", "tracking"):  # the section as a mapping
            if rest := _section_secrets_to_env(name, value):
                kept.append(f"{key}={json.dumps(rest)}")
        elif not (equals and _secret_to_env(name, value.strip())):
            kept.append(item)
    return kept


def _section_secrets_to_env(section: str, value: str):
    """The mapping `value` gives config section `section`, less its credentials, which go
    into their environment variables."""
    from lsreplay.core.config import ConfigError

    try:
        given = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"override {section}=...: its value is not a YAML mapping of {section}'s keys (not shown: "
                          f"it may hold credentials); write it as {section}={{key: value, ...}}") from None
    if not isinstance(given, dict):
        return given
    return {k: v for k, v in given.items() if not _secret_to_env(f"{section}.{k}", str(v))}


def _secret_to_env(name: str, value: str) -> bool:
    """Put `value` of config key `name` into its environment variable if it is a credential."""
    from lsreplay.core.config import has_credentials

    variables = {**SECRET_ENV, **CREDENTIAL_URL_ENV}
    if name in SECRET_ENV or (name in CREDENTIAL_URL_ENV and has_credentials(value)):
        os.environ[variables[name]] = value
        return True
    return False


def _prepare_logging() -> None:
    # Library logs (lsreplay.*) show in the terminal and in the Prefect UI next to the
    # task logs; must be set before Prefect configures logging on import.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lsreplay")


def _train(args) -> int:
    from lsreplay.core.config import load_config

    overrides = secrets_to_env(args.overrides)
    return _run_flow(load_config(args.config, overrides), args.force, args.wait, config_path=args.config,
                     overrides=overrides)


def _resume(args) -> int:
    from lsreplay.core.run import open_run_config

    overrides = secrets_to_env(args.overrides) + ([f"steps={args.steps}"] if args.steps else [])
    return _run_flow(open_run_config(args.run_dir, overrides), args.force, args.wait, from_step=args.from_step,
                     resume=args.run_dir, overrides=overrides)


def _run_flow(cfg, force: bool, wait: bool, from_step: int | None = None, **flow_args) -> int:
    """Check the inputs and that Prefect answers, take the run's lock (waiting for another
    process's with `wait`), forget what came after the checkpoint of `from_step` if given,
    then run the training flow, which holds the lock through."""
    _prepare_logging()
    from flows.prefect_api import connect
    from lsreplay.core.run_lock import hold
    from lsreplay.stages.preflight import preflight

    run = preflight(cfg, force=force)
    connect()  # before the lock, whose file would start the run directory of a run that cannot start
    with hold(run.store, wait=wait):
        if from_step is not None:
            from lsreplay.state.checkpointing import restart_after

            restart_after(run, from_step)
        from flows.train import train

        metrics = train(force=force, **flow_args)
    print(f"finished {sum('loss' in m for m in metrics)} steps; metrics in the run directory's metrics.jsonl")
    return 0


def _serve(args) -> int:
    _prepare_logging()
    from lsreplay.core.config import load_config

    overrides = secrets_to_env(args.overrides)
    load_config(args.config, overrides)
    from flows.prefect_api import connect
    from flows.serve import serve

    connect()
    config = os.path.abspath(args.config) if args.config else None
    serve(config, overrides, cron=args.cron, interval=args.interval, name=args.name)
    return 0


def _export(args) -> int:
    from lsreplay.core.run import Run, open_run_config
    from lsreplay.state.checkpointing import export_policy

    cfg = open_run_config(args.run_dir, secrets_to_env(args.overrides), runs_code=False)  # it only copies weights
    step, files = export_policy(Run(cfg), args.out, args.step, adapters=args.adapters)
    size = sum(e["bytes"] for e in files.values())
    kind = ("a PEFT adapter folder (peft.PeftModel.from_pretrained onto the base model)" if args.adapters else
            "an HF model folder (AutoModelForCausalLM.from_pretrained, vllm serve)")
    print(f"wrote the policy of step {step} to {args.out} ({len(files)} files, {size / 2**20:.1f} MiB): {kind}")
    return 0


def _config(args) -> int:
    """The resolved config (secrets redacted), validated; --check also runs the preflight
    checks of a run (store, model, trackers, reward functions, data) without training."""
    from lsreplay.core.config import load_config, to_yaml

    cfg = load_config(args.config, secrets_to_env(args.overrides))
    print(to_yaml(cfg), end="")
    if args.check:
        from lsreplay.stages.preflight import preflight

        preflight(cfg, force=args.force)
    print(f"# valid{': the run can start' if args.check else ''} (secrets redacted)", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from lsreplay.models.loading import convert_smollm2

    print(convert_smollm2(args.cache_dir))
    return 0


def _plan(args) -> int:
    from lsreplay.commands.plan import main as plan_main

    return plan_main([args.config, *args.overrides])


def _report(args) -> int:
    from lsreplay.commands.report import write_report

    print(write_report(args.run_dirs, args.out))
    return 0


def _generate(args) -> int:
    from lsreplay.commands.generate import generate

    g = generate(args.prompt, args.model, args.policy, args.drafter, args.max_new_tokens, args.draft_len,
                 args.temperature)
    print(g.text)
    print(f"tokens={g.new_tokens} tokens_per_s={g.tokens_per_s:.2f} accept_len={g.accept_len:.2f}")
    return 0


def flags_to_overrides(argv: list[str], own: set[str]) -> list[str]:
    """TRL's and HF's command-line spelling of a key, `--num_generations 8`, `--max-steps=5`
    or a bare `--bf16` (true), as the `key=value` override it stands for: the config then
    names lsreplay's key for TRL's and verl's, or takes lsreplay's own (`--steps 2`). The
    command's own options (`own`) and what follows them stay as they are."""
    out, i = [], 0
    while i < len(argv):
        item = argv[i]
        name, eq, value = item.partition("=")
        if not item.startswith("--") or name in own or len(name) == 2:
            out.append(item)
        else:
            if not eq:
                follows = argv[i + 1] if i + 1 < len(argv) else None
                is_value = follows is not None and "=" not in follows and not follows.startswith("--")
                value, i = (follows, i + 1) if is_value else ("true", i)
            out.append(f"{name[2:].replace('-', '_')}={value}")
        i += 1
    return out


def _config_and_overrides(args) -> None:
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)  # `lsreplay train steps=2`: no config file given
        args.config = None


WAIT_HELP = "if another process runs this run, wait for it to end (default: exit 2 naming it)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lsreplay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run or resume RL training (a Prefect flow)")
    train.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=2 rollout.branching=[4,2]")
    train.add_argument("--force", action="store_true", help="resume even if result-affecting config keys changed")
    train.add_argument("--wait", action="store_true", help=WAIT_HELP)
    train.set_defaults(fn=_train)
    resume = sub.add_parser("resume", help="continue a run from the config saved in its directory")
    resume.add_argument("run_dir", help="the run directory, or its storage URI (s3://bucket/prefix)")
    resume.add_argument("overrides", nargs="*", help="key=value overrides, e.g. storage.endpoint_url=...")
    resume.add_argument("--steps", type=int, help="total steps (more than before extends the run)")
    resume.add_argument("--from-step", type=int, help="continue from the kept policy checkpoint of this step "
                        "(not the newest): what came after it is forgotten")
    resume.add_argument("--force", action="store_true", help="accept overrides that change results")
    resume.add_argument("--wait", action="store_true", help=WAIT_HELP)
    resume.set_defaults(fn=_resume)
    export = sub.add_parser("export", help="write a policy checkpoint as an HF model folder")
    export.add_argument("run_dir", help="the run directory, or its storage URI (s3://bucket/prefix)")
    export.add_argument("out", help="a new local folder")
    export.add_argument("overrides", nargs="*", help="storage overrides, e.g. storage.endpoint_url=...")
    export.add_argument("--step", type=int, help="the step's checkpoint (default: the newest complete one)")
    export.add_argument("--adapters", action="store_true", help="with model.lora: the adapters as a PEFT folder "
                        "(default: merged into the base, an HF model folder)")
    export.set_defaults(fn=_export)
    serve = sub.add_parser("serve", help="serve the training flow as a Prefect deployment on a schedule")
    serve.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    serve.add_argument("overrides", nargs="*", help="key=value overrides")
    when = serve.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    when.add_argument("--interval", type=float, help="run every SECONDS")
    serve.add_argument("--name", default="lsreplay-train", help="deployment name")
    serve.set_defaults(fn=_serve)
    config = sub.add_parser("config", help="print the resolved config (secrets redacted) and validate it")
    config.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    config.add_argument("overrides", nargs="*", help="key=value overrides (+key=value, ++key=value too)")
    config.add_argument("--check", action="store_true", help="also check the store, model, trackers, reward "
                        "functions and data, as a run does before it starts")
    config.add_argument("--force", action="store_true", help="with --check: accept a config that differs from "
                        "the existing run's")
    config.set_defaults(fn=_config)
    convert = sub.add_parser("convert-model", help="convert the shipped SmolLM2 GGUF to an HF folder (once)")
    convert.add_argument("--cache-dir", default=".cache/models")
    convert.set_defaults(fn=_convert)
    plan = sub.add_parser("plan", help="per-device memory plan of a config's RL step; exit 1 if it does not fit")
    plan.add_argument("config", help="YAML config")
    plan.add_argument("overrides", nargs="*", help="key=value overrides")
    plan.set_defaults(fn=_plan)
    report = sub.add_parser("report", help="markdown + PNG report of one or more runs, overlaid")
    report.add_argument("run_dirs", nargs="+", help="run directories")
    report.add_argument("--out", default="report", help="output folder (report.md, curves.png, curves.json)")
    report.set_defaults(fn=_report)
    gen = sub.add_parser("generate", help="speculative generation with a trained drafter (lossless)")
    gen.add_argument("prompt")
    gen.add_argument("--drafter", required=True, help="exported drafter folder: checkpoints/drafter/step_N/hf")
    gen.add_argument("--policy", help="policy checkpoint folder: checkpoints/policy/step_N (default: base model)")
    gen.add_argument("--model", default="smollm2-135m-instruct", help="base model (model.path)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--draft-len", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(fn=_generate)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = sub.choices.get(argv[0]) if argv else None
    # A command's own options, from argparse's list of its actions (it has no public one).
    if command is not None and any(a.dest == "overrides" for a in command._actions):
        argv = argv[:1] + flags_to_overrides(argv[1:], {s for a in command._actions for s in a.option_strings})
    # Overrides may also follow options (`resume RUN --steps 5 pool.slots=2`).
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides += extra
    if args.command in ("train", "serve", "config"):
        _config_and_overrides(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    from lsreplay.core.config import ConfigError
    from lsreplay.core.layout import CheckpointError
    from lsreplay.core.run import StageFailed
    from lsreplay.core.run_lock import RunLockLost
    from lsreplay.core.storage import StorageError
    from lsreplay.data.sources import DatasetError
    from lsreplay.models.loading import ModelError

    try:
        return args.fn(args)
    except (ConfigError, DatasetError, ModelError, StorageError, CheckpointError) as e:
        print(f"lsreplay: error: {e}", file=sys.stderr)
        return 2
    except StageFailed as e:
        print(f"lsreplay: error: {e}", file=sys.stderr)
        return 2 if e.bad_input else 1
    except RunLockLost as e:
        print(f"lsreplay: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
