"""One writer per run: a second `lsreplay train` on a run another process runs exits 2
naming it (or waits with --wait), the lock of a local run is a flock, of an S3 run a lease
with a heartbeat (conditional writes on a real S3-protocol server), and served runs of a
deployment run one at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import boto3
import pytest
from flowrun import REPO, digests, lsreplay_chain, reference_run, tiny
from s3server import BUCKET, KEY, SECRET

from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from lsreplay.core.run_lock import LEASE_ENV, LOCK_KEY, Holder, RunLocked, RunLockLost, hold
from lsreplay.core.storage import Store


def test_two_runs_on_one_directory_one_refuses_and_the_other_trains_as_a_solo_run(
        prefect_server, tiny_model_dir, tmp_path_factory, tmp_path, monkeypatch):
    """A starts the run and holds it (its step 0 rollouts stall for a while); B, the same
    command, exits 2 naming A's process; C, the same with --wait, waits for A to end, then
    finds every stage finished. A's weights equal the reference run's, computed alone."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    monkeypatch.setenv("LSREPLAY_STALL_SECONDS", "40")
    run_dir, logs = tmp_path / "run", {name: tmp_path / name for name in "abc"}
    for folder in logs.values():
        folder.mkdir()
    command = ["train", *tiny(run_dir, tiny_model_dir), "threads=1"]
    first: list = []
    a = threading.Thread(target=lambda: first.extend(lsreplay_chain([(command, "trees@0:stall")], logs["a"])))
    a.start()
    holder = None
    for _ in range(300):  # A takes the lock as its flow starts
        if (run_dir / LOCK_KEY).is_file() and (holder := Holder.parse((run_dir / LOCK_KEY).read_bytes())):
            break
        time.sleep(0.2)
    assert holder is not None and a.is_alive()
    refused, waited = lsreplay_chain([(command, ""), ([*command, "--wait"], "")], logs["b"])
    a.join()
    assert first[0]["returncode"] == 0, first[0]["log"][-3000:]
    assert refused["returncode"] == 2, refused["log"][-3000:]
    assert f"is being run by another process (host {holder.host}, pid {holder.pid}, since {holder.since}): one " \
           "writer per run. Wait for it to end (--wait waits for it)" in refused["log"]
    assert waited["returncode"] == 0, waited["log"][-3000:]
    assert "is being run by another process" in waited["log"] and "waiting for it to end" in waited["log"]
    assert digests(run_dir, "checkpoints") == digests(ref.run_dir, "checkpoints")
    ran = Run(load_config(None, [f"run_dir={run_dir}"])).executions()
    assert set(ran.values()) == {1}, ran  # every stage once, by A; C found them all finished
    assert not (run_dir / LOCK_KEY).exists()


def holding(store_uri: str, options: dict, seconds: float) -> subprocess.Popen:
    """Another process holding the run's lock for `seconds`; it prints "held" once it has it."""
    code = ("import json, sys, time\nfrom lsreplay.core.run_lock import hold\nfrom lsreplay.core.storage import Store\n"
            "with hold(Store(sys.argv[1], json.loads(sys.argv[2]))):\n    print('held', flush=True)\n"
            "    time.sleep(float(sys.argv[3]))\n")
    child = subprocess.Popen([sys.executable, "-c", code, store_uri, json.dumps(options), str(seconds)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.fixture
def bucket_run(s3_endpoint, monkeypatch):
    """(store, options) of a fresh run prefix in the bucket, its lease 2 s long."""
    monkeypatch.setenv(LEASE_ENV, "2")
    _, options = s3_endpoint
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    return Store(uri, options), options


def test_a_bucket_lease_refuses_a_second_holder_and_is_taken_over_once_its_holder_is_gone(bucket_run):
    store, options = bucket_run
    other = holding(store.uri, options, 600)
    try:
        time.sleep(3)  # more than a lease: it renews
        with pytest.raises(RunLocked, match=rf"is being run by another process \(host \S+, pid {other.pid}, since"):
            with hold(store):
                pass
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    with hold(store):  # its process is gone (this host): taken over at once, no lease to wait out
        assert Holder.parse(store.read_versioned(LOCK_KEY)[0]).pid == os.getpid()
    assert not store.exists(LOCK_KEY)  # released


def test_a_bucket_lease_not_renewed_is_taken_over_after_its_life(bucket_run, s3_endpoint):
    """A lease from another host, last renewed now, by the server's clock: refused; waited
    for (--wait), it is taken over once the lease's life (2 s here) has passed unrenewed."""
    store, _ = bucket_run
    elsewhere = Holder("another-host", 4242, "2026-01-01T00:00:00+00:00", uuid.uuid4().hex)
    store.write_if(LOCK_KEY, elsewhere.encode(), None)
    with pytest.raises(RunLocked, match="host another-host, pid 4242"):
        with hold(store):
            pass
    start = time.monotonic()
    with hold(store, wait=True):
        assert 1.5 < time.monotonic() - start < 15
        assert Holder.parse(store.read_versioned(LOCK_KEY)[0]).pid == os.getpid()


def test_a_holder_whose_lease_is_taken_over_stops(bucket_run, s3_endpoint):
    store, options = bucket_run
    endpoint, _ = s3_endpoint
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET)
    with hold(store) as lock:
        lock.check()
        usurper = Holder("another-host", 1, "now", uuid.uuid4().hex)
        s3.put_object(Bucket=BUCKET, Key=f"{store.uri.removeprefix(f's3://{BUCKET}/')}/{LOCK_KEY}",
                      Body=usurper.encode())
        time.sleep(2)  # a renewal (every 2/3 s) finds the lease not as it left it
        with pytest.raises(RunLockLost, match="another process took the run's lease over; it stops"):
            lock.check()
    assert Holder.parse(store.read_versioned(LOCK_KEY)[0]) == usurper  # not deleted: not this process's


def test_served_runs_of_one_deployment_run_one_at_a_time(prefect_server):
    """The deployment `lsreplay serve` registers has a concurrency limit of 1: the server
    keeps a second flow run from starting while the first runs (AwaitingConcurrencySlot)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Pending, Running

    from flows.serve import deployment

    deployment_id = deployment(None, ["steps=2"], interval=3600, name=f"one-{uuid.uuid4().hex[:8]}").apply()
    with get_client(sync_client=True) as client:
        first, second = (client.create_flow_run_from_deployment(deployment_id) for _ in range(2))
        assert client.set_flow_run_state(first.id, Pending()).status == SetStateStatus.ACCEPT
        assert client.set_flow_run_state(first.id, Running()).status == SetStateStatus.ACCEPT
        refused = client.set_flow_run_state(second.id, Pending())
        assert refused.status == SetStateStatus.REJECT and refused.state.name == "AwaitingConcurrencySlot"
