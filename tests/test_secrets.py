"""Secrets and trust: credentials never reach what a run writes or sends, in any spelling;
the vLLM process gets only the environment it needs; a resume runs only code its own
command names. (A whole S3 run's flow-run parameters, logs and bucket: test_s3_flow.)"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from s3server import BUCKET, KEY

from lsreplay import cli
from lsreplay.core.config import ConfigError, load_config, to_dict, to_yaml
from lsreplay.core.run import Run, open_run_config, open_store
from lsreplay.core.storage import RETRIES_ENV

SECRET = "s3cr3t-do-not-print"
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "MLFLOW_TRACKING_URI")

# Every way a command line can give a credential: the keys, Hydra's + and ++, a section as a
# mapping, and URLs with a password or a token.
SPELLINGS = [
    ["storage.key=id", f"storage.secret={SECRET}"],
    ["+storage.key=id", f"++storage.secret={SECRET}"],
    [f"storage={{uri: 's3://{BUCKET}/run', key: id, secret: {SECRET}}}"],
    [f"storage.endpoint_url=http://id:{SECRET}@127.0.0.1:9"],
    [f"+tracking.mlflow_uri=https://id:{SECRET}@mlflow.example.com"],
    [f"tracking={{project: p, mlflow_uri: 'https://mlflow.example.com/?token={SECRET}'}}"],
]


@pytest.fixture
def clean_environment(monkeypatch):
    """None of the credential variables set; whatever a test sets there goes again after it."""
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that the test's own value is undone too
        monkeypatch.delenv(name)


@pytest.mark.parametrize("overrides", SPELLINGS, ids=lambda o: o[-1].split("=")[0])
def test_credentials_in_every_spelling_travel_by_environment(overrides, clean_environment, capsys):
    """What the command keeps as overrides (a flow run's and a deployment's parameters) holds
    no credential: it went into its environment variable, where the run reads it. The rest
    of a section given whole stays."""
    from flows.serve import deployment

    kept = cli.secrets_to_env(overrides)
    assert SECRET not in repr(kept)
    assert any(SECRET in os.environ.get(name, "") for name in CREDENTIAL_VARIABLES)
    if overrides[0].startswith("storage={"):
        assert kept == [f'storage={{"uri": "s3://{BUCKET}/run"}}'] and os.environ["AWS_ACCESS_KEY_ID"] == "id"
    d = deployment(None, kept, interval=3600, name="hourly")
    assert SECRET not in json.dumps(d.parameters) and d.parameters["overrides"] == kept
    assert cli.main(["config", *overrides]) == 0
    assert SECRET not in capsys.readouterr().out


def test_a_config_file_with_credentials_is_written_and_shown_redacted(tmp_path, capsys):
    """Credentials in a YAML config (keys, a URL's password, a token in its query) are read
    as given, and written (config.yaml and config.json of the run, which trackers also get)
    and printed (`lsreplay config`) as ***."""
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nstorage:\n  key: id\n  secret: {SECRET}\n"
                      f"  endpoint_url: http://id:{SECRET}@127.0.0.1:9/s3\ntracking:\n"
                      f"  mlflow_uri: https://mlflow.example.com/api?token={SECRET}&experiment=3\n")
    cfg = load_config(config)
    assert cfg.storage.secret == SECRET and SECRET in cfg.tracking.mlflow_uri  # the run uses them
    shown = to_dict(cfg)
    assert (shown["storage"]["secret"], shown["storage"]["endpoint_url"], shown["tracking"]["mlflow_uri"]) == (
        "***", "http://***@127.0.0.1:9/s3", "https://mlflow.example.com/api?token=***&experiment=3")
    run = Run(cfg)
    run.save_or_check_config()
    for name in ("config.yaml", "config.json"):
        assert SECRET not in (tmp_path / "run" / name).read_text()
    assert SECRET not in to_yaml(cfg)
    assert cli.main(["config", str(config)]) == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "http://***@127.0.0.1:9/s3" in out.out


def test_an_unreachable_endpoint_is_named_without_its_credentials(tmp_path, clean_environment, monkeypatch, capsys):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv(RETRIES_ENV, "0")  # lsreplay's retries (3.5 s of backoff) would only repeat the message
    assert cli.main(["train", "storage.uri=s3://bucket/run", f"storage.endpoint_url=http://id:{SECRET}@127.0.0.1:9",
                     "storage.key=k", f"storage.secret={SECRET}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the store s3://bucket/run at http://***@127.0.0.1:9" in err and SECRET not in err, err


def test_the_vllm_process_gets_no_credentials_and_reports_no_usage(monkeypatch):
    from lsreplay.rollout.vllm_engine import engine_environment

    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN",
                 "VLLM_API_KEY", "PREFECT_API_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    env = engine_environment()
    assert SECRET not in json.dumps(env)
    assert env["PATH"] == os.environ["PATH"] and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_PROC_BIND"] == "close"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


# A run whose stored config names code: a reward function of its own, and a model folder.
NAMES_CODE = ["reward.functions=[tests.varied_rewards:alike_on_even_prompts]", "model.path=/models/theirs"]


def stored_run(uri: str, options: list[str]) -> str:
    """A run's config.json at `uri` (as `lsreplay train` writes it), naming NAMES_CODE."""
    cfg = load_config(None, [*options, *NAMES_CODE])
    Run(cfg, open_store(cfg)).save_or_check_config()
    return uri


def test_a_resume_from_a_bucket_runs_only_code_its_command_names(s3_endpoint, clean_environment, monkeypatch):
    """Whoever can write the bucket can change config.json: a resume refuses the code it names
    unless the command names it too (then the command's value is what runs)."""
    endpoint, options = s3_endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    where = [f"storage.endpoint_url={endpoint}"]
    stored_run(uri, [f"storage.uri={uri}", *where])
    with pytest.raises(ConfigError) as refused:
        open_run_config(uri, where)
    message = str(refused.value)
    assert f"{uri}/config.json names code, a model, data or destinations this resume would use: reward.functions=" \
           '["tests.varied_rewards:alike_on_even_prompts"] model.path=/models/theirs' in message, message
    assert "a resume takes these from its own command: repeat them" in message
    with pytest.raises(ConfigError, match="model.path=/models/theirs"):  # one of the two given
        open_run_config(uri, [*where, "reward.functions=[tests.varied_rewards:alike_on_even_prompts]"])
    cfg = open_run_config(uri, [*where, *NAMES_CODE])
    assert cfg.model.path == "/models/theirs"
    assert open_run_config(uri, where, runs_code=False).model.path == "/models/theirs"  # `lsreplay export`


def test_a_run_folder_others_can_write_is_not_trusted_with_code(tmp_path):
    run_dir = tmp_path / "run"
    stored_run(str(run_dir), [f"run_dir={run_dir}"])
    assert open_run_config(str(run_dir)).model.path == "/models/theirs"  # this user's own folder
    run_dir.chmod(0o777)
    with pytest.raises(ConfigError, match="names code, a model, data or destinations this resume would use"):
        open_run_config(str(run_dir))
