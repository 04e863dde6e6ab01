"""Tests for lsreplay.core.storage: round trips on a local directory and on S3, atomic writes,
corruption and absence detection, and errors for an unreachable endpoint."""

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from s3server import BUCKET, SECRET

from lsreplay.core.storage import BACKOFF_ENV, CorruptEntry, MissingEntry, Store, StorageError


def test_bytes_round_trip_and_entry(store):
    assert not store.exists("a/b.bin")
    entry = store.write_bytes("a/b.bin", b"hello")
    assert entry == {
        "key": "a/b.bin",
        "uri": f"{store.uri}/a/b.bin",
        "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        "bytes": 5,
    }
    assert store.exists("a/b.bin")
    assert not store.exists("a")  # a folder-like prefix is not an entry
    assert store.read_bytes("a/b.bin", entry["sha256"]) == b"hello"
    store.write_bytes("a/b.bin", b"again")
    assert store.read_bytes("a/b.bin") == b"again"


def test_json_round_trip(store):
    obj = {"b": [1, 2.5, None], "a": {"nested": "x"}}
    entry = store.write_json("m.json", obj)
    assert store.read_json("m.json", entry["sha256"]) == obj
    assert store.write_json("m.json", dict(reversed(obj.items())))["sha256"] == entry["sha256"]


def test_tensors_round_trip(store):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "base": base,
        "transposed": base.t(),  # non-contiguous view of base
        "row": base[1],  # contiguous view sharing base's storage
        "bf16": torch.randn(5).to(torch.bfloat16),
        "ids": torch.tensor([1, -2, 3], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(7.0),
        "empty": torch.zeros(0, 3, dtype=torch.float64),
    }
    entry = store.write_tensors("t.safetensors", tensors, metadata={"step": "3"})
    loaded = store.read_tensors("t.safetensors", entry["sha256"])
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # Written piece by piece from the tensors' memory (read back above by safetensors), with
    # the metadata in its header; the entry's sha256 and size are the file's.
    data = store.read_bytes("t.safetensors")
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
    assert json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"] == {"step": "3"}


def test_list_and_delete(store):
    for key in ["step_1/a", "step_1/sub/b", "step_10/a", "top"]:
        store.write_bytes(key, b"x")
    assert store.list() == ["step_1/a", "step_1/sub/b", "step_10/a", "top"]
    assert store.list("step_1") == ["step_1/a", "step_1/sub/b"]
    assert store.list("absent") == []
    store.delete("top")
    store.delete("top")  # deleting again is not an error
    store.delete_prefix("step_1")
    assert store.list() == ["step_10/a"]
    with pytest.raises(ValueError):
        store.delete_prefix("")


def test_local_folder_holds_the_entries_and_a_copy_is_removed(store):
    store.write_bytes("hf/config.json", b"{}")
    store.write_bytes("hf/sub/model.safetensors", b"weights")
    store.write_bytes("other", b"x")
    with store.local_folder("hf") as folder:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}
        assert files == {"config.json": b"{}", "sub/model.safetensors": b"weights"}
    assert Path(folder).is_dir() == store.local  # a local store's own folder stays; a copy does not


def test_an_object_named_with_dots_is_not_copied_out_of_the_folder(s3_endpoint, tmp_path, monkeypatch):
    """An object store's keys are any strings: an object named hf/../../victim under a run's
    prefix would be copied to ../../victim from the temporary folder. It is refused before
    anything is opened (before, the file there was truncated first)."""
    import tempfile
    import uuid

    import boto3

    endpoint, options = s3_endpoint
    prefix = uuid.uuid4().hex
    store = Store(f"s3://{BUCKET}/{prefix}", options)
    store.write_bytes("hf/config.json", b"{}")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=options["key"],
                 aws_secret_access_key=SECRET).put_object(Bucket=BUCKET, Key=f"{prefix}/hf/../../victim", Body=b"x")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a" / "b"))  # the copy's folder: a/b/lsreplay-store-*
    (tmp_path / "a" / "b").mkdir(parents=True)
    victim = tmp_path / "a" / "victim"  # where ../../victim from that folder lands
    victim.write_bytes(b"precious")
    with pytest.raises(CorruptEntry, match=r"an object named '\.\./victim' under hf: a key with an empty, '\.' or "
                                           r"'\.\.' part"):
        with store.local_folder("hf"):
            pass
    assert victim.read_bytes() == b"precious"


def test_missing_entry(store):
    with pytest.raises(MissingEntry, match="nothing/here"):
        store.read_bytes("nothing/here")
    with pytest.raises(MissingEntry):
        store.read_tensors("nothing.safetensors")


def test_flipped_byte_is_corrupt(store):
    entry = store.write_tensors("w.safetensors", {"w": torch.ones(16)})
    data = bytearray(store.read_bytes("w.safetensors"))
    data[-3] ^= 0xFF
    store.write_bytes("w.safetensors", bytes(data))
    with pytest.raises(CorruptEntry, match="w.safetensors"):
        store.read_tensors("w.safetensors", entry["sha256"])


def test_truncated_safetensors_is_corrupt_without_hash(store):
    store.write_tensors("w.safetensors", {"w": torch.ones(16)})
    data = store.read_bytes("w.safetensors")
    store.write_bytes("w.safetensors", data[: len(data) // 2])
    with pytest.raises(CorruptEntry, match="w.safetensors"):
        store.read_tensors("w.safetensors")


def test_invalid_json_is_corrupt(store):
    store.write_bytes("m.json", b'{"a": ')
    with pytest.raises(CorruptEntry, match="m.json"):
        store.read_json("m.json")


def test_failed_serialisation_writes_nothing(store):
    with pytest.raises(TypeError):
        store.write_tensors("bad.safetensors", {"ok": torch.ones(2), "bad": [1, 2]})
    assert not store.exists("bad.safetensors")
    assert store.list() == []


@pytest.mark.parametrize("key", ["", "/", "a/../b", "a//b", "./a"])
def test_invalid_keys_are_refused(tmp_path, key):
    with pytest.raises(ValueError):
        Store(str(tmp_path)).write_bytes(key, b"x")


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_local_write_failure_leaves_old_entry_and_no_temp(tmp_path, monkeypatch, failing):
    monkeypatch.setenv(BACKOFF_ENV, "0.01")  # each failing write is tried 4 times (3.5 s apart in all by default)
    store = Store(str(tmp_path))
    store.write_bytes("d/k", b"old")

    def boom(*args, **kwargs):
        raise OSError("disk failed mid-write")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(StorageError, match="d/k"):
        store.write_bytes("d/k", b"new")
    with pytest.raises(StorageError):
        store.write_bytes("d/fresh", b"new")
    monkeypatch.undo()
    assert store.read_bytes("d/k") == b"old"
    assert not store.exists("d/fresh")
    assert store.list() == ["d/k"]
    assert os.listdir(tmp_path / "d") == ["k"]


def test_temp_file_of_a_killed_writer_is_invisible(tmp_path):
    store = Store(str(tmp_path))
    store.write_bytes("d/k", b"x")
    # What a writer killed between write and rename leaves behind.
    (tmp_path / "d" / "k2.lsreplay-tmp-0123abcd").write_bytes(b"partial")
    assert store.list() == ["d/k"]
    assert not store.exists("d/k2")


def test_uri_normalisation(tmp_path):
    assert Store(f"{tmp_path}/x/../run/").uri == str(tmp_path / "run")
    assert Store(f"file://{tmp_path}/run").url("a/b") == f"{tmp_path}/run/a/b"


def test_s3_uri_and_repr_hide_credentials(s3_endpoint):  # noqa: F811
    _, options = s3_endpoint
    store = Store(f"s3://{BUCKET}/run/", options)
    assert store.uri == f"s3://{BUCKET}/run"
    assert store.url("k") == f"s3://{BUCKET}/run/k"
    assert SECRET not in repr(store) and SECRET not in str(store)


def test_unreachable_endpoint_raises_quickly_without_secret():
    options = {
        "key": "k",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    store = Store(f"s3://{BUCKET}/run", options)
    start = time.monotonic()
    for call in (lambda: store.exists("k"), lambda: store.write_bytes("k", b"x"), store.list):
        with pytest.raises(StorageError) as info:
            call()
        message = str(info.value)
        assert "127.0.0.1:9" in message and "endpoint_url" in message
        assert SECRET not in message
    assert time.monotonic() - start < 10
