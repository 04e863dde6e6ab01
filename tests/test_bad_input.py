"""Bad input stops with a clear message naming the problem and what to do, before any work
where it can be checked up front. (NaN loss: test_faults; damaged stage outputs and
checkpoints, which are recomputed: test_resume.)"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from flowrun import reference_run, step0_copy, unique_pool

from lsreplay import cli

LSREPLAY = Path(__file__).resolve().parents[1] / "lsreplay"


def error(capsys) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("steps=abc", "config key 'steps'"),
    ("model.pth=x", "unknown config key 'model.pth'; allowed keys under 'model'"),
    ("rollout.branching=[]", "rollout.branching"),
    ("storage.uri=ftp://x/y", "storage.uri"),
])
def test_config_errors(override, message, capsys):
    assert cli.main(["train", override]) == 2
    assert message in error(capsys)


@pytest.mark.parametrize("text, message", [
    ("steps: 2\n  seed: 1\n", "is not valid YAML (mapping values are not allowed in this context at line 2, column 7)"),
    ("rollout:\n  branching: [4, 2\n", "is not valid YAML (did not find expected ',' or ']' at line 3, column 1)"),
    ("- steps\n- 2\n", "holds a list, not a mapping of config keys"),
])
def test_malformed_config_file(text, message, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert cli.main(["train", str(config), f"run_dir={tmp_path / 'run'}"]) == 2
    err = error(capsys)
    assert f"config file {config} {message}" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("rollout.branching=[4,2", "its value is not valid YAML (did not find expected ',' or ']' at its end); close its "
                               "brackets and braces"),
    ("data.task_args={a: [1}", "(did not find expected ',' or ']' at character 7)"),
    ("seed=@x", "(found character that cannot start any token at character 1)"),
])
def test_malformed_override(override, message, capsys):
    assert cli.main(["config", override]) == 2
    err = error(capsys)
    assert f"override {override!r}: " in err and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "'model.lora.rank' = 0 is not allowed: an integer >= 1 (the adapters' rank, e.g. 16); to "
                          "train the full weights instead set model.lora.enabled=false"),
    ("model.lora.target_modules=[q_proj,qkv_proj]", "model.lora.target_modules names 'qkv_proj', which "
                                                    "LlamaForCausalLM does not have; its decoder layers' linear layers "
                                                    "are ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', "
                                                    "'up_proj', 'v_proj']: list some of those"),
    ("model.lora.target_modules=[input_layernorm]", "names 'input_layernorm', a LlamaRMSNorm, which PEFT cannot wrap "
                                                    "with LoRA here (linear layers only)"),
    ("model.lora.target_modules=[lm_head]", "names 'lm_head', which is outside the decoder layers"),
    ("model.lora.dropout=0.05", "'model.lora.dropout' = 0.05 is not allowed: 0"),
    ("rollout.engine=vllm model.lora.rank=1024", "'model.lora.rank' = 1024 is not allowed: at most 512 with "
                                                 "rollout.engine=vllm"),
])
def test_lora_errors(override, message, tiny_model_dir, tmp_path, capsys):
    """Checked before any work (the preflight builds the model on the meta device)."""
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                     "model.lora.enabled=true", *override.split()]) == 2
    err = error(capsys)
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_metadata_column_that_is_not_json(tmp_path, tiny_model_dir, capsys):
    """A prompt file's `metadata` column holds JSON objects as strings (reasoning-gym's
    prompts), or structs. One that does not parse stops the run before any work, naming the
    file and the row (before, a JSONDecodeError in a stage, retried as transient)."""
    rows = [{"question": f"{i}+1?", "answer": str(i + 1), "task": "basic_arithmetic",
             "metadata": json.dumps({"i": i}) if i != 2 else "{'i': 2}"} for i in range(4)]
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={prompts}"]) == 2
    err = error(capsys)
    assert f"{prompts}: row 2: the column 'metadata' holds \"{{'i': 2}}\", not JSON: Expecting property name " \
           "enclosed in double quotes at character 2; write it as a JSON object" in err, err
    assert not (tmp_path / "run").exists()


# Entries of a run that are valid JSON but not of the structure lsreplay writes: each stops a
# resume with exit status 2, naming the entry and what to do (before: a KeyError's traceback).
MALFORMED = {
    "config.json": ('{"config": {}}', "is valid JSON but not a run's config.json", "restore it"),
    "step_0001/trees.done.json": ('{"files": [{"key": "step_0001/trees.json"}]}', "is valid JSON but not a done "
                                  "marker", "delete it, and the stage runs again"),
    "checkpoints/policy/step_0001/checkpoint.json": ('{"step": 1}', "is valid JSON but not a checkpoint record",
                                                     "delete the folder"),
    "metrics.jsonl": ('{"step": 0}\n{"loss": 1.0}\n', "line 2 of", "fix or delete that line"),
}


@pytest.mark.parametrize("entry", MALFORMED)
def test_entries_of_another_structure_stop_a_resume(entry, prefect_server, tiny_model_dir, tmp_path_factory,
                                                    tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory, tiny_model_dir).run_dir, run_dir)
    text, what, fix = MALFORMED[entry]
    (run_dir / entry).write_text(text)
    assert cli.main(["resume", str(run_dir), unique_pool()]) == 2
    err = error(capsys)
    assert f"{run_dir / entry}" in err and what in err and fix in err and "Traceback" not in err, err


def test_missing_config_file(capsys):
    assert cli.main(["train", "no/such/config.yaml"]) == 2
    assert "config file no/such/config.yaml does not exist" in error(capsys)


def test_missing_model_path(tmp_path, capsys):
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'nope'}"]) == 2
    err = error(capsys)
    assert "is not an HF model folder (no config.json there)" in err and "give a local folder" in err
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_pickled_weights_are_not_loaded(tmp_path, tiny_model_dir, capsys):
    """A model folder with pytorch_model.bin only: a pickle, which runs code as it loads.
    Refused before any work, saying how to convert it; the model loads with use_safetensors."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled-model"
    shutil.copytree(tiny_model_dir, model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={model}"]) == 2
    err = error(capsys)
    assert f"{model} has no safetensors weights" in err and "pytorch_model.bin: pickled weights" in err, err
    assert "save_pretrained(folder) writes model.safetensors" in err
    assert not (tmp_path / "run").exists()


def test_missing_dataset_file_and_field(tmp_path, tiny_model_dir, capsys):
    base = [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}"]
    assert cli.main(["train", *base, f"data.path={tmp_path / 'prompts.jsonl'}"]) == 2
    assert "prompt file not found" in error(capsys)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1?", "task": "basic_arithmetic"}) + "\n" for i in range(4)))
    assert cli.main(["train", *base, f"data.path={rows}"]) == 2
    err = error(capsys)
    assert "required field 'answer' is missing" in err and "Add 'answer' to every row" in err


def test_preference_dataset_missing_a_column(tmp_path, tiny_model_dir, capsys):
    rows = tmp_path / "prefs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1?", "chosen": str(i + 1)}) + "\n" for i in range(4)))
    offline = ["algo.name=dpo", "algo.dpo_source=dataset", f"data.path={rows}", "drafter.enabled=false"]
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", *offline]) == 2
    err = error(capsys)
    assert "needs the columns ['prompt', 'chosen', 'rejected']" in err and "['rejected'] missing" in err, err
    assert not (tmp_path / "run").exists()  # stopped before any work


@pytest.mark.parametrize("overrides", [["data.tasks=[gsm_symbolic]"], ["CONFIG", "data.tasks=[basic_arithmetic]"]])
def test_task_args_of_tasks_not_asked_for_do_not_stop_a_run(overrides, tmp_path, tiny_model_dir):
    """The default data.task_args belong to tasks these runs leave out: ignored, so the run
    passes every check made before Prefect starts."""
    from lsreplay.core.config import load_config
    from lsreplay.data.prompt_sets import training_prompts
    from lsreplay.stages.preflight import preflight

    config = str(LSREPLAY.parent / "configs/default.yaml") if overrides[0] == "CONFIG" else None
    cfg = load_config(config, [*overrides[1 if config else 0:], f"run_dir={tmp_path / 'run'}",
                               f"model.path={tiny_model_dir}", "data.size=16"])
    preflight(cfg)
    assert set(training_prompts(cfg).column("task")) == set(cfg.data.tasks)


@pytest.mark.parametrize("overrides, message", [
    (["data.task_args={basic_arithmetic: {digits: 3}}"],
     "data.task_args.basic_arithmetic = {'digits': 3} rejected by reasoning-gym task 'basic_arithmetic'"),
    (["data.tasks=[gsm_symbolik]"], "data.tasks: unknown task 'gsm_symbolik': neither lsreplay's (kv_retrieval) nor "
                                    "reasoning-gym's; valid names include gsm_symbolic"),
    (["reward.function=no_such_module_15:score"], "reward function 'no_such_module_15:score': no module named"),
    (["eval.every=1", "eval.size=300", "data.size=304", "data.max_prompt_tokens=1024"],
     "distinct questions, fewer than eval.size=300; lower eval.size, or raise data.size"),
    (["data.max_prompt_tokens=40"], "tokens, more than data.max_prompt_tokens=40; raise the limit"),
    # The tiny model's 2,048 positions (LlamaConfig's default).
    (["data.max_prompt_tokens=4096"], "needs 4144 positions (data.max_prompt_tokens=4096 + 48 completion tokens) but "),
    (["data.max_prompt_tokens=4096"], "reaches 2048 (max_position_embeddings); stretch its rotary positions with "
                                      "model.rope_scaling={rope_type: yarn, factor: 3}"),
])
def test_data_problems_stop_before_prefect_starts(overrides, message, tmp_path, tiny_model_dir, capsys):
    """One line, exit status 2, and nothing written to the run directory."""
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", *overrides]) == 2
    err = error(capsys)
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_own_tasks_need_own_reward(tmp_path, tiny_model_dir, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1), "task": "sums"}) + "\n"
                            for i in range(4)))
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={rows}"]) == 2
    assert "tasks ['sums'] are not reasoning-gym tasks, so the default reward cannot score them; give " \
           "reward.functions=[module:function]" in error(capsys)


def test_unreachable_storage_endpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the S3 client's own retries: not needed here
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-show-me")
    assert cli.main(["train", "storage.uri=s3://bucket/run", "storage.endpoint_url=http://127.0.0.1:9"]) == 2
    err = error(capsys)
    assert "cannot reach the store s3://bucket/run at http://127.0.0.1:9" in err
    assert "check storage.endpoint_url, that the server is up, and the credentials" in err
    assert "do-not-show-me" not in err


def test_resume_of_no_run(tmp_path, capsys):
    assert cli.main(["resume", str(tmp_path)]) == 2
    assert "holds no run (no config.json there); start one with `lsreplay train`" in error(capsys)


def test_checkpoint_that_does_not_fit_the_model(prefect_server, tiny_model_dir, tmp_path_factory, tmp_path, capsys):
    """A run continued (--force) with another model: its checkpoint cannot be loaded into
    it. The run stops naming the stage, the step, the checkpoint and what to do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = step0_copy(ref, tmp_path / "run")
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = AutoConfig.from_pretrained(other)
    config.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    assert cli.main(["resume", str(run_dir), f"model.path={other}", "--steps", "2", "--force", unique_pool()]) == 1
    err = error(capsys)
    assert re.search(r"stage trees of step 1 failed: CheckpointError: checkpoint \S+checkpoints/policy/step_0000/"
                     r"model.safetensors does not fit", err), err
    assert "unexpected keys" in err and "load it into the architecture and config it was saved from" in err
    assert not (run_dir / "step_0001/trees.done.json").exists()


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def test_nothing_read_back_is_unpickled():
    """Stored state is safetensors and JSON: lsreplay/ imports no unpickler and calls
    torch.load only with weights_only=True (code only: comments and docs may say 'pickle')."""
    offenders = []
    for path in sorted(LSREPLAY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(LSREPLAY.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in UNPICKLERS for a in node.names):
                offenders.append(f"{where}: import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLERS:
                offenders.append(f"{where}: from {node.module} import ...")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{where}: {ast.unparse(node)}")
    assert offenders == [], "unpickling in lsreplay/ (use safetensors/JSON, or weights_only=True):\n" + \
        "\n".join(offenders)


def test_vllm_engine_problems_stop_before_any_work(tmp_path, tiny_model_dir, capsys):
    """rollout.engine=vllm without vLLM, with a model vLLM cannot run, with a KV cache larger
    than the machine: one line each, exit 2, nothing written."""
    base = ["train", f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm"]
    assert cli.main([*base, f"model.path={tiny_model_dir}", "rollout.vllm.python=/no/such/python"]) == 2
    assert "rollout.vllm.python=/no/such/python does not exist" in error(capsys)
    unknown = tmp_path / "unknown-arch"
    shutil.copytree(tiny_model_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    assert cli.main([*base, f"model.path={unknown}"]) == 2
    assert "cannot run" in error(capsys)
    assert cli.main([*base, f"model.path={tiny_model_dir}", "rollout.vllm.kv_cache_gb=100000"]) == 2
    assert "lower rollout.vllm.kv_cache_gb" in error(capsys)
    assert not (tmp_path / "run").exists()


def test_a_drafter_of_an_older_format_stops_a_resume(prefect_server, tiny_model_dir, tmp_path_factory, tmp_path,
                                                     capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory, tiny_model_dir).run_dir, run_dir)
    export = run_dir / "checkpoints/drafter/step_0001/hf/config.json"
    config = json.loads(export.read_text())
    export.write_text(json.dumps({**config, "lsreplay_drafter": {**config["lsreplay_drafter"], "format": "eagle1"}}))
    assert cli.main(["resume", str(run_dir), "--steps", "3", unique_pool()]) == 2
    assert "holds a drafter of format 'eagle1'" in error(capsys)


def test_a_replay_budget_too_small_for_the_prompts_stops_before_any_work(tmp_path, tiny_model_dir, capsys):
    """Prompts of up to 2000 tokens whose layer inputs and K/V alone take more than
    replay.budget_mb: the preflight refuses, with the budget that would do."""
    assert cli.main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                     "data.max_prompt_tokens=2000", "replay.budget_mb=1"]) == 2
    err = error(capsys)
    assert re.search(r"replay.budget_mb=1 is too small for this tree: .*\(its prompt of 2000 tokens, run layer by "
                     r"layer, holds [0-9.]+ MiB .*; raise replay.budget_mb to at least 2,", err), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
