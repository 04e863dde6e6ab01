"""What a run produces, others load: every policy checkpoint carries an HF model folder,
`lsreplay export` writes one from any complete checkpoint (local or S3), and a run starts
from such a folder, a model id in the local Hugging Face cache, or a chosen kept checkpoint.
(tests/test_vllm.py serves the folders in vLLM.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from flowrun import digests, reference_run, unique_pool
from s3server import BUCKET, KEY, SECRET
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lsreplay import cli

from lsreplay.core.config import load_config
from lsreplay.core.layout import STAGES
from lsreplay.core.run import Run
from lsreplay.models.loading import ModelError, load_model, resolve_model_dir
from lsreplay.models.train_state import TrainState
from lsreplay.state import checkpointing

PROMPT = torch.tensor([[1, 17, 300, 4021, 9, 77, 12, 5]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits.float()


def test_every_checkpoint_holds_the_trained_policy_as_an_hf_folder(prefect_server, tiny_model_dir,
                                                                     tmp_path_factory):
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    for step in (0, 1):
        ckpt = ref.run_dir / f"checkpoints/policy/step_{step:04d}"
        hf = ckpt / "hf"
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
        assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"
        record = json.loads((ckpt / "checkpoint.json").read_text())
        assert {"hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"} <= set(record["files"])
        # float32 weights are the masters' bytes: one file, linked, not written twice
        assert (hf / "model.safetensors").stat().st_ino == (ckpt / "model.safetensors").stat().st_ino

    hf = ref.run_dir / "checkpoints/policy/step_0001/hf"
    served = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    trained = load_model(load_config(None, [f"model.path={tiny_model_dir}"]).model, trainable=False)
    trained.load_state_dict(load_file(hf.parent / "model.safetensors"), strict=False)
    assert torch.equal(logits(served), logits(trained))
    tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert tokenizer.chat_template and tokenizer.eos_token == AutoTokenizer.from_pretrained(tiny_model_dir).eos_token


def _train_state(cfg) -> TrainState:
    model = load_model(cfg.model)
    train = TrainState(model, cfg.optim)
    with torch.no_grad():  # a "trained" policy: not the base model
        for p in train.masters:
            p.add_(1e-2 * torch.randn_like(p))
    train.follow_masters()
    return train


def test_bf16_runs_write_bf16_folders_sharded_above_the_configured_size(tiny_model_dir, tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "model.dtype=bfloat16",
                             "checkpoint.hf_shard_gb=0.002"])  # ~2 MiB shards of a ~7 MiB model
    run = Run(cfg)
    train = _train_state(cfg)
    checkpointing.write(run, checkpointing.snapshot(run, 0, train))
    ckpt = tmp_path / "run/checkpoints/policy/step_0000"
    index = json.loads((ckpt / "hf/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (ckpt / "hf/model.safetensors").exists()
    assert all(t.dtype == torch.bfloat16 for s in shards for t in load_file(ckpt / "hf" / s).values())
    assert all(t.dtype == torch.float32 for t in load_file(ckpt / "model.safetensors").values())  # the masters
    assert json.loads((ckpt / "hf/config.json").read_text())["dtype"] == "bfloat16"
    served = AutoModelForCausalLM.from_pretrained(ckpt / "hf", local_files_only=True)
    assert served.dtype == torch.bfloat16
    assert torch.equal(logits(served), logits(train.model))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.bfloat16)
    assert not torch.allclose(logits(served), logits(base))  # the trained policy, not the base model


def test_export_writes_a_folder_from_a_local_or_s3_run_and_refuses_bad_input(prefect_server, tiny_model_dir,
                                                                               tmp_path_factory, tmp_path,
                                                                               s3_endpoint, capsys):
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    out = tmp_path / "exported"
    assert cli.main(["export", str(ref.run_dir), str(out), "--step", "0"]) == 0
    assert "wrote the policy of step 0" in capsys.readouterr().out
    from_ckpt = AutoModelForCausalLM.from_pretrained(ref.run_dir / "checkpoints/policy/step_0000/hf")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(from_ckpt))

    assert cli.main(["export", str(ref.run_dir), str(out)]) == 2  # OUT exists
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["export", str(ref.run_dir), str(tmp_path / "other"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no complete policy checkpoint of step 7" in err and "[0, 1]" in err
    assert not (tmp_path / "other").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]

    endpoint, _ = s3_endpoint
    s3 = [f"storage.uri=s3://{BUCKET}/export-run", f"storage.endpoint_url={endpoint}", f"storage.key={KEY}",
          f"storage.secret={SECRET}"]
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *s3])
    run = Run(cfg)
    run.save_or_check_config()
    train = _train_state(cfg)
    checkpointing.write(run, checkpointing.snapshot(run, 0, train))
    assert cli.main(["export", f"s3://{BUCKET}/export-run", str(tmp_path / "from-s3"), *s3[1:]]) == 0
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "from-s3")), logits(train.model))


def test_model_path_takes_an_hf_folder_or_a_cached_model_id(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub

    cfg = load_config(None, [f"model.path={tiny_model_dir}"]).model
    assert resolve_model_dir(cfg) == tiny_model_dir
    # The layout huggingface_hub's cache keeps: models--org--name/{refs/main, snapshots/<commit>/...}
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / commit
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    cached = load_config(None, ["model.path=someone/tiny-llama"]).model
    assert resolve_model_dir(cached) == snapshot
    assert torch.equal(logits(load_model(cached, trainable=False)), logits(load_model(cfg, trainable=False)))
    with pytest.raises(ModelError, match="nor a model id in the local Hugging Face cache"):
        resolve_model_dir(load_config(None, ["model.path=someone/not-downloaded"]).model)


def test_resume_from_a_chosen_kept_checkpoint(prefect_server, tiny_model_dir, tmp_path_factory, tmp_path, capsys):
    """Back to step 0's checkpoint: step 1 runs again and ends bit-identical to the first time."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = tmp_path / "run"
    shutil.copytree(ref.run_dir, run_dir)
    shutil.rmtree(run_dir / "executions")
    assert cli.main(["resume", str(run_dir), unique_pool(), "--from-step", "5"]) == 2
    assert "no complete policy checkpoint" in capsys.readouterr().err
    assert cli.main(["resume", str(run_dir), unique_pool(), "--from-step", "0"]) == 0
    assert digests(run_dir, "checkpoints", "step_0001") == digests(ref.run_dir, "checkpoints", "step_0001")
    assert Run(load_config(None, [f"run_dir={run_dir}"])).executions() == {(1, s): 1 for s in STAGES}
