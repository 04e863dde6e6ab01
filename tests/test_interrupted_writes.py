"""Writes cut short by a kill leave nothing behind for good: a local write's temporary file,
an S3 multipart upload that never completed. The store sweeps them (never a write of its
own process in progress); a run does so when it starts and when it finishes, so that after
a resume only the files the run names remain."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import boto3
import torch
from flowrun import lsreplay_chain, tiny, unique_pool
from s3server import BUCKET, KEY, SECRET

from lsreplay.core import faults
from lsreplay.core.run_lock import LEASE_ENV
from lsreplay.core.storage import PART_BYTES_ENV, Store

PART = 5 * 2**20  # S3's smallest part
WEIGHTS = "checkpoints/policy/step_0000/model.safetensors"


def big(seed: int) -> dict[str, torch.Tensor]:
    """12.6 MB of tensors in several pieces: three parts of PART bytes."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(2**20, generator=g) for i in range(3)}


def s3_client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                        aws_secret_access_key=SECRET)


def leftovers(store: Store, endpoint: str) -> dict[str, str]:
    """What interrupted writes left in the store, and the entry each was to be: local
    temporary files by path, S3 incomplete multipart uploads by upload id."""
    if not store.uri.startswith("s3://"):
        root = Path(store.uri)
        return {str(p.relative_to(root)): str(p.relative_to(root)).split(".lsreplay-tmp-")[0]
                for p in root.rglob("*") if ".lsreplay-tmp-" in p.name}
    prefix = store.uri.removeprefix(f"s3://{BUCKET}/") + "/"
    uploads = s3_client(endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return {u["UploadId"]: u["Key"].removeprefix(prefix) for u in uploads}


def killed_writing(store: Store, options: dict, key: str, tensors: dict) -> int:
    """Write `tensors` as `key` in a forked child that the fault checkpoint@0:tear kills
    halfway through; returns the child's exit status as subprocess gives it (-9)."""
    if (child := os.fork()) == 0:
        os.environ[faults.ENV] = "checkpoint@0:tear"
        Store(store.uri, options if store.uri.startswith("s3://") else None).write_tensors(key, tensors)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def test_a_sweep_removes_what_killed_writes_left_and_spares_writes_in_progress(store, s3_endpoint, monkeypatch):
    endpoint, options = s3_endpoint
    s3 = store.uri.startswith("s3://")
    monkeypatch.setenv(PART_BYTES_ENV, str(PART))
    kept = store.write_tensors("checkpoints/policy/step_0000/meta.safetensors", {"x": torch.ones(3)})
    assert killed_writing(store, options, WEIGHTS, big(0)) == -signal.SIGKILL
    left = leftovers(store, endpoint)
    assert list(left.values()) == [WEIGHTS] and store.list() == [kept["key"]]
    (stranded,) = left
    if s3:  # an upload with one part of three, never completed: no object
        prefix = store.uri.removeprefix(f"s3://{BUCKET}/")
        parts = s3_client(endpoint).list_parts(Bucket=BUCKET, Key=f"{prefix}/{WEIGHTS}", UploadId=stranded)["Parts"]
        assert [p["Size"] for p in parts] == [PART]
        expected = {"files": 0, "bytes": 0, "uploads": 1}
    else:  # the header and the first of three tensors
        size = (Path(store.uri) / stranded).stat().st_size
        assert 4 * 2**20 < size < 5 * 2**20
        expected = {"files": 1, "bytes": size, "uploads": 0}

    # Swept from the middle of a write of this process (as a finished run sweeps while
    # nothing else writes): the killed write's leftovers go, the write in progress stands.
    during: list = []

    def sweep_midway(key: str) -> None:
        during.append((store.sweep_interrupted_writes(), leftovers(store, endpoint)))

    monkeypatch.setattr(faults, "partly_written", sweep_midway)
    entry = store.write_tensors(WEIGHTS, big(1))
    ((swept, in_progress),) = during
    assert swept == expected
    assert list(in_progress.values()) == [WEIGHTS] and stranded not in in_progress
    assert store.list() == sorted([kept["key"], WEIGHTS]) and leftovers(store, endpoint) == {}
    assert torch.equal(store.read_tensors(WEIGHTS, entry["sha256"])["w2"], big(1)["w2"])
    assert store.sweep_interrupted_writes() == {"files": 0, "bytes": 0, "uploads": 0}


def named(store: Store) -> set[str]:
    """The files a run names: its config, metrics and curves; each done marker and the files
    it lists; each complete policy checkpoint's record and the files it lists; the records
    of stage executions."""
    out = {"config.yaml", "config.json", "metrics.jsonl", "curves.png"}
    for key in store.list():
        if key.endswith(".done.json"):
            out |= {key, *(e["key"] for e in store.read_json(key).get("files", []))}
        elif key.startswith("checkpoints/policy/") and key.endswith("/checkpoint.json"):
            out |= {key, *(e["key"] for e in store.read_json(key)["files"].values())}
        elif key.startswith("executions/"):
            out.add(key)
    return out


def everything(store: Store, endpoint: str) -> set[str]:
    """Every file under the store's root, hidden ones included, and every incomplete upload."""
    if store.uri.startswith("s3://"):
        prefix = store.uri.removeprefix(f"s3://{BUCKET}/") + "/"
        pages = s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        objects = {o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])}
    else:
        root = Path(store.uri)
        objects = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    return objects | {f"{key} (incomplete upload)" for key in leftovers(store, endpoint).values()}


def test_a_run_killed_writing_its_checkpoint_resumes_to_nothing_but_its_named_files(
        prefect_server, s3_endpoint, tiny_model_dir, tmp_path, monkeypatch):
    """SIGKILLed halfway through the weights file of its checkpoint, locally and in S3: the
    store holds a partial temporary file, or an incomplete multipart upload. The resume
    removes it and rewrites the checkpoint; then the store holds exactly what the run names."""
    endpoint, options = s3_endpoint
    monkeypatch.setenv(PART_BYTES_ENV, str(PART))  # the tiny model's 12.6 MB of weights: three parts
    monkeypatch.setenv(LEASE_ENV, "2")
    prefix = f"runs/{uuid.uuid4().hex[:8]}"
    s3 = [f"storage.uri=s3://{BUCKET}/{prefix}", f"storage.endpoint_url={endpoint}", f"storage.key={KEY}",
          f"storage.secret={SECRET}"]
    local = tmp_path / "local"
    stores = [Store(str(local)), Store(f"s3://{BUCKET}/{prefix}", options)]
    killed = lsreplay_chain([(["train", *tiny(local, tiny_model_dir, steps=1)], "checkpoint@0:tear"),
                             (["train", *tiny(tmp_path / "unused", tiny_model_dir, steps=1), *s3],
                              "checkpoint@0:tear")], tmp_path)
    assert [r["returncode"] for r in killed] == [-signal.SIGKILL] * 2, killed[-1]["log"][-3000:]
    for store in stores:  # (another thread's write may have been cut short too)
        assert WEIGHTS in leftovers(store, endpoint).values(), store
        assert everything(store, endpoint) - named(store)  # the leftovers, at least

    # The killed run's lease runs out 2 s after its last renewal (--wait waits for it); the local
    # run_dir and the model folder the bucket's config names are named again.
    resumed = lsreplay_chain([(["resume", str(local), unique_pool()], ""),
                              (["resume", f"s3://{BUCKET}/{prefix}", *s3[1:], f"model.path={tiny_model_dir}",
                                f"run_dir={tmp_path / 'unused'}", "--wait", unique_pool()], "")], tmp_path)
    assert [r["returncode"] for r in resumed] == [0, 0], resumed[-1]["log"][-3000:]
    for store in stores:
        assert leftovers(store, endpoint) == {}
        assert everything(store, endpoint) == named(store), store
        assert store.exists("checkpoints/policy/step_0000/checkpoint.json")
    assert not (tmp_path / "unused").exists()
