"""A whole run kept in S3 (a moto server on loopback): everything lands in the bucket, a
rerun resumes from there without redoing anything, and the secret shows up nowhere."""

from __future__ import annotations

import boto3
from flowrun import tiny
from s3server import BUCKET, KEY, SECRET

from lsreplay import cli
from lsreplay.core.layout import STAGES

PREFIX = "runs/tiny"


def objects(endpoint: str) -> dict[str, bytes]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/")
            for o in page.get("Contents", [])]
    return {k.removeprefix(PREFIX + "/"): s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def test_run_in_s3_resumes_and_keeps_no_secret(prefect_server, s3_endpoint, tiny_model_dir, tmp_path,  # noqa: F811
                                              monkeypatch, capfd):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    endpoint, _ = s3_endpoint
    # The CLI moves storage.key/secret into these variables; monkeypatch puts them back after.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unset")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unset")
    local = tmp_path / "not-used"
    # Credentials in Hydra's spellings here and as a section given whole below: none reaches a
    # flow run's parameters (test_secrets: every spelling).
    args = ["train", *tiny(local, tiny_model_dir), f"storage.uri=s3://{BUCKET}/{PREFIX}",
            f"storage.endpoint_url={endpoint}", f"+storage.key={KEY}", f"++storage.secret={SECRET}"]
    assert cli.main(args) == 0
    first = capfd.readouterr()

    stored = objects(endpoint)
    for key in ["config.yaml", "config.json", "metrics.jsonl", "curves.png", "step_0000/prompts.json",
                "step_0001/trees/shard_00.json", "checkpoints/policy/step_0001/model.safetensors",
                "checkpoints/policy/step_0001/optimizer.safetensors", "checkpoints/drafter/step_0001/model.safetensors",
                *[f"step_{s:04d}/{stage}.done.json" for s in (0, 1) for stage in STAGES]]:
        assert key in stored, key
    # Each step's prefix K/V and hidden states are deleted once nothing reads them again.
    assert not any(k.startswith(("step_0000/prefix_kv/", "step_0001/activations/")) for k in stored)
    assert stored["metrics.jsonl"].count(b"\n") == 2
    assert not local.exists()  # nothing written beside the bucket
    executions = sorted(k for k in stored if k.startswith("executions/"))
    assert len(executions) == 2 * len(STAGES)

    # Resume from the bucket: every stage is found finished; nothing runs again. The model
    # folder and the local run_dir the bucket's config names are named again: a resume takes
    # what names a model or where the run writes from its own command.
    assert cli.main(["resume", f"s3://{BUCKET}/{PREFIX}", f"storage.endpoint_url={endpoint}",
                     f"storage={{key: {KEY}, secret: {SECRET}}}", f"model.path={tiny_model_dir}",
                     f"run_dir={local}"]) == 0
    second = capfd.readouterr()
    again = objects(endpoint)
    assert sorted(k for k in again if k.startswith("executions/")) == executions
    assert {k: v for k, v in again.items() if k.startswith("checkpoints/")} == \
        {k: v for k, v in stored.items() if k.startswith("checkpoints/")}

    # The secret is nowhere: not in the bucket, the output, the flow runs' parameters or logs.
    secret = SECRET.encode()
    assert [k for k, v in again.items() if secret in v] == []
    for out in (first.out, first.err, second.out, second.err):
        assert SECRET not in out
    assert "finished 2 steps" in first.out
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=20)
        ours = [r for r in runs if f"s3://{BUCKET}/{PREFIX}" in repr(r.parameters)]
        assert len(ours) == 2
        assert all(SECRET not in repr(r.parameters) and KEY not in repr(r.parameters) for r in ours)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in ours])))
        assert logs and not [x.message for x in logs if SECRET in x.message]
        flow_ids = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in ours]))
        assert all(r.state.is_completed() for r in client.read_flow_runs(flow_run_filter=flow_ids))


def test_served_deployment_keeps_secrets_out_of_its_parameters(monkeypatch):
    from flows.serve import deployment

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unset")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unset")
    overrides = cli.secrets_to_env(["steps=2", f"storage.key={KEY}", f"storage.secret={SECRET}"])
    d = deployment("configs/default.yaml", overrides, interval=3600, name="nightly")
    assert d.parameters == {"config_path": "configs/default.yaml", "overrides": ["steps=2"]}
    assert SECRET not in repr(d.parameters) and len(d.schedules) == 1
    import os

    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET  # the served runs inherit it
