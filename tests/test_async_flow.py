"""Asynchronous rollouts in the real flow (rollout.max_staleness = 1, a rollout device of their
own): step t + 1's rollouts run while step t's update does, as Prefect's task runs show; every
tree records the policy version that sampled it; and a run SIGKILLed in a rollout, in an
update with the next step's trees already sampled, and in the last update, then resumed, ends
with every tree and the policy weights bit-identical to an uninterrupted run, the trees
sampled before a kill kept and used, none trained twice."""

from __future__ import annotations

import json

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flowrun import digests, lsreplay_chain, tiny, tree_records, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.run import Run

ASYNC = ["rollout.max_staleness=1", "pool.slots=2", "pool.rollout_devices=[1]",
         "reward.function=tests.varied_rewards:code_parity"]
COMPARED = ["checkpoints/policy", "step_0000/trees", "step_0001/trees", "step_0002/trees"]


def task_spans(flow_run_id) -> dict[str, tuple]:
    """Each task run of the flow run by name: (start, end), as the Prefect UI draws them."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: (r.start_time, r.end_time) for r in runs}


def test_rollouts_run_ahead_of_the_update_and_resume_bit_identical(prefect_server, tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    from flows.train import train

    ref = tmp_path / "reference"
    # Step 2's rollouts are held 4 s in their middle: they are sampling while step 1's update runs.
    monkeypatch.setenv("LSREPLAY_FAULTS", "trees@2:stall")
    monkeypatch.setenv("LSREPLAY_STALL_SECONDS", "4")
    state = train(overrides=[*tiny(ref, tiny_model_dir, steps=3), *ASYNC], return_state=True)
    monkeypatch.delenv("LSREPLAY_FAULTS")
    spans = task_spans(state.state_details.flow_run_id)
    rollout, update = spans["generate-tree-shard-0 step 2"], spans["train-policy step 1"]
    assert rollout[0] < update[1] and update[0] < rollout[1], spans  # two steps' task runs at once
    assert [{t["policy_version"] for t in tree_records(ref, s)} for s in range(3)] == [{0}, {0}, {1}]
    metrics = state.result()
    assert [m["staleness_mean"] for m in metrics] == [0, 1, 1]
    assert [m["trees_stale_dropped"] for m in metrics] == [0, 0, 0]
    assert all("off_policy/staleness1/logprob_gap" in m for m in metrics[1:])

    run_dir = tmp_path / "run"
    start = ["train", *tiny(run_dir, tiny_model_dir, steps=3), *ASYNC, "threads=1"]  # as the reference computed
    jobs = [(start, "trees@1:kill"),  # in a rollout, step 0's update alongside
            # in step 1's update, step 2's trees sampled meanwhile (the caching pass held 3 s)
            (["resume", str(run_dir), unique_pool()], "prefixes@1:stall,policy@1:kill"),
            (["resume", str(run_dir), unique_pool()], "policy@2:kill"),
            (["resume", str(run_dir), unique_pool()], "")]
    results = lsreplay_chain(jobs, tmp_path, threads=2)
    assert [r["returncode"] for r in results] == [-9, -9, -9, 0], [r["log"][-2000:] for r in results]
    assert digests(run_dir, *COMPARED) == digests(ref, *COMPARED)
    ran = Run(load_config(None, [f"run_dir={run_dir}"])).executions()
    # Step 2's trees, sampled before the kill in step 1's update, were kept and used by two resumes.
    assert ran[(2, "trees")] == 1 and ran[(1, "policy")] == 2 and ran[(2, "policy")] == 2, ran
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in rows] == [(0, 0), (1, 0), (2, 1)]
