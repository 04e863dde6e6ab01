"""`lsreplay report`: files exist, hold the curves' data, overlay several runs."""

import json

from lsreplay.report import write_report


def fake_run(path, rewards, tree_shape=True):
    path.mkdir(parents=True)
    rows = [{"step": i, "reward_mean": r, "loss": -r, "kl": 0.01 * i, "positions": 100, "per_rollout_positions": 300,
             "trees_seconds": 2.0, "policy_seconds": 1.0, "step_seconds": 3.0, "drafter_top1_accept": 0.1 * i} for i, r in enumerate(rewards)]
    if tree_shape:  # runs logged before leaves carried counts have none of these
        for r in rows:
            r.update(leaves_per_tree=5.5, group_size=8.0, effective_group_size=4.57)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_overlays_runs_and_keeps_the_data(tmp_path):
    fake_run(tmp_path / "baseline", [0.1, 0.2, 0.3])
    fake_run(tmp_path / "replay", [0.1, 0.25, 0.4], tree_shape=False)
    md = write_report([tmp_path / "baseline", tmp_path / "replay"], tmp_path / "out")
    text = md.read_text()
    assert "curves.png" in text and "## baseline" in text and "## replay" in text
    baseline, replay = text.split("## replay")
    assert "| 5.50 / 8 (4.57) |" in baseline and "| - |" in replay  # leaves / G (effective) per tree
    png = (tmp_path / "out/curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    data = json.loads((tmp_path / "out/curves.json").read_text())
    assert data["reward_mean"]["replay"] == [[0, 0.1], [1, 0.25], [2, 0.4]]
    assert data["positions_saved"]["baseline"][0] == [0, 200]
    assert data["step_seconds"]["baseline"][0] == [0, 3.0]
    assert set(data) >= {"loss", "kl", "drafter_top1_accept", "leaves_per_tree"}
    assert data["effective_group_size"] == {"baseline": [[i, 4.57] for i in range(3)]}
