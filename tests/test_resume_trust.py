"""Deny by default on resume: a stored config.json is what whoever can write the store wrote
(the result_hash beside it they can recompute with lsreplay's own function), so every key that
names code, an interpreter, a cluster, a model, its weights, data or where the run writes comes
from the resume's own command where the store is not this user's alone; and every key of the
schema that can name anything (it holds text) is classified, so a new one cannot slip past."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

import pytest
from s3server import BUCKET, KEY

from lsreplay import cli
from lsreplay.core.config import (COMMAND_KEYS, PLAIN_TEXT_KEYS, SECRET_KEYS, Config, ConfigError, command_keys,
                                  from_dict, load_config, result_hash)
from lsreplay.core.run import Run, open_run_config, open_store


def text_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema whose type holds text (str, or a list or dict that may):
    numbers and booleans name nothing."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += text_keys(type(default), f"{prefix}{f.name}.")
        elif re.search(r"\b(str|dict)\b", str(f.type)):
            keys.append(prefix + f.name)
    return keys


def test_every_key_that_holds_text_is_classified_once():
    classified = [*command_keys(), *PLAIN_TEXT_KEYS, *SECRET_KEYS]
    assert len(classified) == len(set(classified)), [k for k in classified if classified.count(k) > 1]
    unclassified = sorted(set(text_keys()) - set(classified))
    assert not unclassified, (f"config keys {unclassified} hold text but are not classified: add each to "
                              "lsreplay.core.config.COMMAND_KEYS (it names code, an interpreter, a cluster, a model, "
                              "weights, data or a destination) or PLAIN_TEXT_KEYS")
    assert not sorted(set(classified) - set(text_keys())), "classified keys that the schema has not (or not as text)"
    assert {"code", "interpreter", "cluster", "model", "weights", "data"} <= set(COMMAND_KEYS)


def test_a_crafted_config_in_a_group_writable_run_folder_imports_nothing(tmp_path, capsys):
    """The issue's attack, end to end: a run folder others can write, its config.json edited to
    name another tool (result_hash recomputed); `lsreplay resume` refuses it before importing
    anything, naming the key and how to give it."""
    run_dir = tmp_path / "run"
    Run(load_config(None, [f"run_dir={run_dir}"])).save_or_check_config()
    ran = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(ran)!r}, 'w').write('imported')\n\n\ndef tool(x: int) -> int:\n"
                    '    """Identity.\n\n    Args:\n        x: a number\n    """\n    return x\n')
    stored = json.loads((run_dir / "config.json").read_text())
    stored["config"]["rollout"].update(tools=[f"{evil}:tool"], max_turns=2)
    stored["result_hash"] = result_hash(from_dict(stored["config"]))
    (run_dir / "config.json").write_text(json.dumps(stored))
    run_dir.chmod(0o775)  # group-writable: not this user's alone

    assert cli.main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir}/config.json names code, a model, data or destinations this resume would use: " \
           f'rollout.tools=["{evil}:tool"]; whoever can write the store can change that file, so a resume takes ' \
           "these from its own command: repeat them" in err, err
    assert not ran.exists()
    run_dir.chmod(0o755)  # this user's own record: trusted as it stands
    assert open_run_config(str(run_dir)).rollout.tools == [f"{evil}:tool"]


# A stored config naming one key of each kind (and one of each kind the issue found taken as stored).
STORED = {"rollout.tools": ["their_tools:tool"], "rollout.environment": "their_env:Env", "rollout.max_turns": 2,
          "model.attn_implementation": "kernels-community/flash-attn", "rollout.vllm.python": "/usr/bin/python3",
          "pool.ray_address": "ray://their-head:10001", "model.path": "/models/theirs",
          "model.cache_dir": "/tmp/their-cache", "data.path": "/data/theirs.jsonl", "eval.path": "/data/held.jsonl",
          "eval.every": 1, "tracking.mlflow_uri": "http://their-server:5000", "tracking.dir": "/tmp/their-tracking"}


def test_a_resume_from_a_bucket_takes_every_kind_from_its_command(s3_endpoint, monkeypatch):
    endpoint, options = s3_endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    where = [f"storage.uri={uri}", f"storage.endpoint_url={endpoint}"]
    cfg = load_config(None, [*where, *(f"{k}={json.dumps(v)}" for k, v in STORED.items())])
    Run(cfg, open_store(cfg)).save_or_check_config()
    with pytest.raises(ConfigError) as refused:
        open_run_config(uri, where[1:])
    named = str(refused.value).split("would use: ")[1].split("; whoever")[0]
    assert sorted(re.findall(r"(\S+?)=", named)) == sorted(k for k in STORED if k in command_keys()), named
    given = [f"{k}={json.dumps(v)}" for k, v in STORED.items() if k in command_keys()]
    resumed = open_run_config(uri, [*where[1:], *given])
    assert resumed.pool.ray_address == STORED["pool.ray_address"] and resumed.data.path == STORED["data.path"]
    # A section given as a mapping gives the keys inside it, not the others of the section.
    with pytest.raises(ConfigError, match="pool.ray_address="):
        open_run_config(uri, [*where[1:], *(g for g in given if not g.startswith("pool.")), "pool={slots: 2}"])
