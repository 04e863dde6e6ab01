"""The issue's expressions in a real step: a model that calls a tool on `2**100` or on
`(((10**100)**100)**100)**100` (minutes of one `**` holding the interpreter) samples its
episodes on a run kept in S3 under a 2 s lease. With the built-in calculator the expression is
refused at once (every number sized first); with a tool marked untrusted (plain eval) its child
process is killed at rollout.tool_timeout_seconds. Either way the rollouts end within their
timeouts, and the run's lease is never lost."""

from __future__ import annotations

import sys
import time
import uuid

import pytest
from conftest import write_bigram_model
from s3server import BUCKET, KEY, SECRET
from transformers import AutoTokenizer

from lsreplay import stages
from lsreplay.core.config import load_config
from lsreplay.core.run_lock import LEASE_ENV, LOCK_KEY, Holder, hold
from lsreplay.core.sandbox import close_children
from lsreplay.stages.common import load_trees
from lsreplay.stages.preflight import preflight

SMALL, STALLING = "2**100", "(((10**100)**100)**100)**100"
TAIL = '"}}</tool_call>'
TOOL_TIMEOUT = 1  # each stalled call holds a core this long


def caller_model(tiny_model_dir, out, tool: str):
    """The tiny model as a bigram machine (no attention, no MLP: the last token decides the
    next) that, after the generation prompt's newline, calls `tool` on SMALL or STALLING alike
    (each an added token), then ends its turn."""
    head = f'<tool_call>{{"name": "{tool}", "arguments": {{"expression": "'

    def following(tokenizer):
        head_id, small, stalling, tail = tokenizer.convert_tokens_to_ids([head, SMALL, STALLING, TAIL])
        return {tokenizer.encode("\n")[0]: [head_id], head_id: [small, stalling], small: [tail], stalling: [tail],
                tail: [tokenizer.eos_token_id]}

    write_bigram_model(tiny_model_dir, out, [head, SMALL, STALLING, TAIL], following)
    return out


EVALUATE = '''
def evaluate(expression: str) -> str:
    """Evaluate an expression as Python does.

    Args:
        expression: the expression
    """
    return str(eval(expression))[-12:]
'''


@pytest.mark.parametrize("tool", ["calculator", "evaluate"])
def test_a_step_of_episodes_on_the_issues_expressions_ends_in_its_timeouts(tool, tiny_model_dir, s3_endpoint,
                                                                            tmp_path, monkeypatch):
    endpoint, _ = s3_endpoint
    monkeypatch.setenv(LEASE_ENV, "2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    (tmp_path / "their_tools.py").write_text(EVALUATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    spec = "lsreplay.data.agentic:calculator" if tool == "calculator" else "their_tools:evaluate"
    model = caller_model(tiny_model_dir, tmp_path / "model", tool)
    cfg = load_config(None, [f"storage.uri=s3://{BUCKET}/{uuid.uuid4().hex}", f"storage.endpoint_url={endpoint}",
                             f"run_dir={tmp_path / 'run'}", f"model.path={model}", "data.size=8",
                             "data.prompts_per_step=2", "rollout.max_new_tokens=8", "drafter.enabled=false",
                             "rollout.branching=[4]", "rollout.branch_at=turns", "rollout.segment_tokens=[]",
                             "rollout.max_turns=2", f"rollout.tools=[{spec}]",
                             f"rollout.untrusted_tools={tool != 'calculator'}",
                             f"rollout.tool_timeout_seconds={TOOL_TIMEOUT}"])
    run = preflight(cfg)
    try:
        with hold(run.store) as lock:
            renewals = Holder.parse(run.store.read_versioned(LOCK_KEY)[0]).renewals
            stages.sample_prompts(run, 0)
            start = time.monotonic()
            stages.generate_trees(run, 0)
            seconds = time.monotonic() - start
            lock.check()  # never lost
            assert Holder.parse(run.store.read_versioned(LOCK_KEY)[0]).renewals > renewals
    finally:
        close_children()
    records = load_trees(run, 0)[0]
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    executed, answers, errors = [], [], 0
    for record in records:
        for leaf, text in enumerate(record["texts"]):
            # Each reply is a call; the first one's is run, the last one's not (no turn left to read it).
            executed.append(text.split('"expression": "')[1].split('"')[0])
            answers.append(tokenizer.decode([t for t, sampled in zip(record["completions"][leaf],
                                                                      record["sampled"][leaf]) if not sampled]))
            errors += record["tool_errors"][leaf]
    stalled = executed.count(STALLING)
    assert stalled and executed.count(SMALL), executed  # both were called: the check shows something
    assert sum(str(2**100)[-12:] in a for a in answers) == executed.count(SMALL)
    assert errors == stalled and sum("error" in a for a in answers) == stalled
    # Each stalling call ends at once (calculator) or at its timeout, its child killed (evaluate);
    # the rest of the step (sampling, restarting children) is seconds.
    assert seconds < (stalled * TOOL_TIMEOUT if tool == "evaluate" else 0) + 120, seconds
