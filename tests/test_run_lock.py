"""One writer per run: a second `lsreplay train` on a run another process runs exits 2
naming it (or waits with --wait), the lock of a local run is a flock, of an S3 run a lease
with a heartbeat (conditional writes on a real S3-protocol server) renewed by a process of its
own that fences every write of its holder, and served runs of a deployment run one at a time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest
from flowrun import REPO, digests, lsreplay_chain, reference_run, tiny
from s3server import BUCKET, KEY, SECRET

from lsreplay.core.config import load_config
from lsreplay.core.faults import STALL_ENV, STALL_UNTIL_ENV
from lsreplay.core.run import Run
from lsreplay.core.run_lock import LEASE_ENV, LOCK_KEY, Holder, RunLocked, RunLockLost, hold
from lsreplay.core.storage import Store


def test_two_runs_on_one_directory_one_refuses_and_the_other_trains_as_a_solo_run(
        prefect_server, tiny_model_dir, tmp_path_factory, tmp_path, monkeypatch):
    """A starts the run and holds it (its step 0 rollouts stall until C waits); B, the same
    command, exits 2 naming A's process; C, the same with --wait, waits for A to end, then
    finds every stage finished. A's weights equal the reference run's, computed alone."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir, logs = tmp_path / "run", {name: tmp_path / name for name in "abc"}
    stalled = tmp_path / "end-of-stall"  # A's stall ends once C says it waits (at most 120 s)
    monkeypatch.setenv(STALL_ENV, "120")
    monkeypatch.setenv(STALL_UNTIL_ENV, str(stalled))
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
    c_log = logs["b"] / "command-1.log"
    ending = threading.Thread(target=end_stall_when, args=(c_log, "waiting for it to end", stalled), daemon=True)
    ending.start()
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


def end_stall_when(log: Path, text: str, stall_end: Path, seconds: float = 120) -> None:
    """Create `stall_end` once `log` shows `text` (or after `seconds`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (log.is_file() and text in log.read_text(errors="replace")):
        time.sleep(0.2)
    stall_end.touch()


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


def test_a_bucket_lease_refuses_a_second_holder_and_is_taken_over_once_unrenewed_for_its_life(bucket_run):
    """A holder of this host killed: its renewer stops with it, and the lease is taken over
    once its life has passed unrenewed, by the heartbeat (not by asking the kernel whether a
    pid of this host's name lives: a process of another container may share the name)."""
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
    killed = time.monotonic()
    with hold(store, wait=True):
        assert time.monotonic() - killed > 1.0  # waited for the life (2 s) since its last renewal
        assert Holder.parse(store.read_versioned(LOCK_KEY)[0]).pid == os.getpid()
    assert not store.exists(LOCK_KEY)  # released


def test_a_fresh_lease_of_this_host_whose_pid_is_gone_is_still_held(bucket_run, monkeypatch):
    """The heartbeat decides: a lease renewed just now by "a process of this host" whose pid
    this kernel does not know (another container's) is refused, then taken after its life."""
    store, _ = bucket_run
    monkeypatch.setenv(LEASE_ENV, "8")  # longer than the refused process takes to ask, however loaded the machine
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    container = Holder(socket.gethostname(), int(gone.stdout), "2026-01-01T00:00:00+00:00", uuid.uuid4().hex)
    store.write_if(LOCK_KEY, container.encode(), None)
    with pytest.raises(RunLocked, match=f"pid {container.pid}"):
        with hold(store):
            pass
    start = time.monotonic()
    with hold(store, wait=True):
        assert 4.0 < time.monotonic() - start < 60


def test_a_bucket_lease_not_renewed_is_taken_over_after_its_life(bucket_run, s3_endpoint, monkeypatch):
    """A lease from another host, last renewed now, by the server's clock: refused; waited
    for (--wait), it is taken over once the lease's life (8 s here) has passed unrenewed."""
    store, _ = bucket_run
    monkeypatch.setenv(LEASE_ENV, "8")  # longer than the refused process takes to ask, however loaded the machine
    elsewhere = Holder("another-host", 4242, "2026-01-01T00:00:00+00:00", uuid.uuid4().hex)
    store.write_if(LOCK_KEY, elsewhere.encode(), None)
    with pytest.raises(RunLocked, match="host another-host, pid 4242"):
        with hold(store):
            pass
    start = time.monotonic()
    with hold(store, wait=True):
        assert 4.0 < time.monotonic() - start < 60
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


def lease_objects(store: Store, endpoint: str):
    """The S3 client and key of the store's lease, to write it as another process would."""
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET)
    return s3, f"{store.uri.removeprefix(f's3://{BUCKET}/')}/{LOCK_KEY}"


def test_a_lease_taken_over_mid_step_fences_every_write_at_once(bucket_run, s3_endpoint):
    """Mid-step, another process takes the lease: the next commit write (a done marker) renews
    the lease first, finds it taken and is refused; so are the plain writes after it, from any
    thread (the background checkpoint writer's), before they start: nothing lands after it."""
    store, _ = bucket_run
    run = Run(load_config(None, [f"storage.uri={store.uri}"]), store)
    s3, key = lease_objects(store, s3_endpoint[0])
    with hold(store):
        run.finish(0, "prompts", {"files": []})  # the step writes while it holds the lease
        s3.put_object(Bucket=BUCKET, Key=key, Body=Holder("another-host", 1, "now", uuid.uuid4().hex).encode())
        with pytest.raises(RunLockLost, match="another process took the run's lease over; it stops"):
            run.finish(0, "trees", {"files": []})
        failed: list = []
        writer = threading.Thread(target=lambda: failed.append(_raised(store.write_bytes, "checkpoints/x", b"x")))
        writer.start()
        writer.join()
        assert isinstance(failed[0], RunLockLost)
    assert run.done(0, "prompts") and not run.done(0, "trees") and not store.exists("checkpoints/x")
    assert Holder.parse(store.read_versioned(LOCK_KEY)[0]).host == "another-host"  # left as the other wrote it


def _raised(function, *args):
    try:
        function(*args)
    except Exception as e:  # noqa: BLE001: what the thread raised is the result
        return e
    return None


def test_a_holder_that_cannot_renew_stops_writing_before_its_lease_can_end(bucket_run):
    """Its renewer stopped (as a cut-off network stops renewals): from the last renewal plus the
    lease's life less its margin, by this machine's monotonic clock, every write is refused,
    before another process may take the lease (its life has not passed)."""
    store, _ = bucket_run
    with hold(store) as lock:
        store.write_bytes("before", b"1")
        os.kill(lock._renewer.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while _raised(store.write_bytes, "during", b"1") is None:
                time.sleep(0.05)
            assert time.monotonic() - stopped < 2.0  # at most the life (2 s) after the last renewal
            with pytest.raises(RunLockLost, match="its lease was not renewed for 2 s"):
                lock.check()
        finally:
            os.kill(lock._renewer.pid, signal.SIGCONT)
    assert store.exists("before")


@pytest.fixture
def moto_process(tmp_path):
    """An S3-protocol server in a process of its own (the session's runs on threads of the test's
    process, which a test holding the interpreter would stop too), with the test bucket."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET)
    for _ in range(300):
        try:
            s3.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # noqa: BLE001: not listening yet
            time.sleep(0.1)
    yield {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    server.kill()
    server.wait()


def hold_the_interpreter(seconds: float) -> float:
    """Hold this process's GIL for about `seconds` (or more) in one `**` on integers, sized from
    a smaller one's time (Karatsuba: time ~ digits**1.585); the seconds it took."""
    start = time.monotonic()
    assert 10 ** 10**6 > 0
    base = max(time.monotonic() - start, 1e-3)
    digits = int(10**6 * (seconds / base) ** (1 / 1.585))
    start = time.monotonic()
    assert 10**digits > 0
    return time.monotonic() - start


def test_the_lease_is_renewed_while_this_process_holds_its_interpreter(moto_process, monkeypatch):
    """The issue's stall: one `**` holds this process's GIL for longer than the lease's life.
    The renewals go on (they are another process's), so a second process that tries to take
    the run after that life is refused, and this one still holds it afterwards."""
    monkeypatch.setenv(LEASE_ENV, "2")
    store = Store(f"s3://{BUCKET}/{uuid.uuid4().hex}", moto_process)
    # The other process tries 3 s (more than the lease's life) into the stall.
    code = ("import json, sys, time\nfrom lsreplay.core.run_lock import RunLocked, hold\n"
            "from lsreplay.core.storage import Store\nprint('ready', flush=True)\ntime.sleep(3)\ntry:\n"
            "    with hold(Store(sys.argv[1], json.loads(sys.argv[2]))):\n        print('took it')\n"
            "except RunLocked:\n    print('refused')\n")
    with hold(store) as lock:
        renewals = Holder.parse(store.read_versioned(LOCK_KEY)[0]).renewals
        other = subprocess.Popen([sys.executable, "-c", code, store.uri, json.dumps(moto_process)],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert other.stdout.readline().strip() == "ready"
        held = hold_the_interpreter(8.0)
        assert other.communicate(timeout=120)[0].strip() == "refused"
        lock.check()  # still this process's
        assert Holder.parse(store.read_versioned(LOCK_KEY)[0]).renewals > renewals + 2
    assert held > 5, f"the power took {held:.1f} s, less than the other's try needs: the test shows nothing"


def test_a_flow_whose_shard_fails_holds_the_run_until_its_other_tasks_end(prefect_server, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    """The deployment path (the flow called as a deployment runs it, no command around it): one
    of two rollout shards fails for good while the other is held in its middle. The flow fails,
    but its lock stays until the other shard has ended (its done marker written): before, the
    flow's body let the lock go while that shard still wrote, unlocked."""
    from flows.train import train

    run_dir = tmp_path / "run"
    monkeypatch.setenv("LSREPLAY_FAULTS", "trees@0:error*1,trees@0:stall")
    monkeypatch.setenv("LSREPLAY_STALL_SECONDS", "6")
    overrides = [*tiny(run_dir, tiny_model_dir, steps=1), "rollout.shards=2", "data.prompts_per_step=2",
                 "pool.slots=2", "threads=1"]
    at_release: list = []

    def watch() -> None:  # the lock file is deleted as its holder lets the lock go
        lock, end = run_dir / LOCK_KEY, time.monotonic() + 300
        while not lock.exists() and time.monotonic() < end:
            time.sleep(0.01)
        while lock.exists() and time.monotonic() < end:
            time.sleep(0.01)
        at_release.extend(sorted(p.name for p in (run_dir / "step_0000").glob("trees-shard*.done.json")))

    watcher = threading.Thread(target=watch)
    watcher.start()
    state = train(overrides=overrides, return_state=True)
    watcher.join()
    assert state.is_failed()
    assert len(at_release) == 1, at_release  # the stalled shard finished before the lock was let go
