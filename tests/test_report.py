"""`lsreplay report`: files exist, hold the curves' data, overlay several runs."""

import json

from lsreplay.commands.report import write_report


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


def test_report_shows_heldout_accuracy_with_its_interval(tmp_path):
    """Evaluations after 0, 1 and 2 updates; the last line holds the evaluation alone."""
    fake_run(tmp_path / "run", [0.1, 0.2])
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()] + [{"step": 2}]
    for r, acc in zip(rows, [0.5, 0.6, 0.75]):
        r.update(eval_accuracy=acc, eval_accuracy_lo=acc - 0.1, eval_accuracy_hi=acc + 0.1)
    (tmp_path / "run/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report([tmp_path / "run"], tmp_path / "out").read_text()
    assert "| 2 | 0.750 [0.650, 0.850] | - | - |" in md
    data = json.loads((tmp_path / "out/curves.json").read_text())
    assert data["eval_accuracy"]["run"] == [[0, 0.5, 0.4, 0.6], [1, 0.6, 0.5, 0.7], [2, 0.75, 0.65, 0.85]]
    assert [p[0] for p in data["positions_saved"]["run"]] == [0, 1]  # no point for the evaluation alone
