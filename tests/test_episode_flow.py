"""Multi-turn episodes through a real training step on the tiny model: an environment that
says "wrong, try again" for up to 3 turns (branching per turn), and a calculator tool
(a tiny model made to call it, branching per turn too). The records flag the environment's tokens, the step's
metrics count turns, tool calls, their errors and environment tokens, the update trains, and a trees
stage cut off after writing its shard (before its done marker) samples the same episodes
again on resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_bigram_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lsreplay import stages
from lsreplay.core.config import load_config
from lsreplay.data import agentic
from lsreplay.data.agentic import ArithmeticFeedback
from lsreplay.metrics.records import step_record
from lsreplay.stages.common import load_trees
from lsreplay.stages.preflight import preflight

FEEDBACK = f"\n<|im_start|>user\n{ArithmeticFeedback.RETRY}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def talkative_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, writing end-of-turn about as often as a digit: its replies end, so
    episodes go on to further turns."""
    out = tmp_path_factory.mktemp("talkative")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[tokenizer.eos_token_id] = head[digits].mean(0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# The calculator call the tool-calling model writes, as two added tokens around its operand.
CALL_HEAD, CALL_TAIL = '<tool_call>{"name": "calculator", "arguments": {"expression": "', '+4"}}</tool_call>'


@pytest.fixture(scope="module")
def tool_calling_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a bigram machine that calls the calculator: no attention and no MLP
    (the last token alone decides the next), and after the generation prompt's newline it
    writes CALL_HEAD, then 3, 5 or x alike, then CALL_TAIL and end-of-turn: 3+4 and 5+4
    compute, x+4 fails."""
    out = tmp_path_factory.mktemp("tool-calling")

    def following(tokenizer):
        head_id, tail_id = tokenizer.convert_tokens_to_ids([CALL_HEAD, CALL_TAIL])
        newline, operands = tokenizer.encode("\n")[0], [tokenizer.encode(c)[0] for c in "35x"]
        return {newline: [head_id], head_id: operands, **{o: [tail_id] for o in operands},
                tail_id: [tokenizer.eos_token_id]}

    write_bigram_model(tiny_model_dir, out, [CALL_HEAD, CALL_TAIL], following)
    return out


def tool_failures(completions, **kwargs) -> list[float]:
    """A TRL-style reward of multi-turn completions: the tool messages that report an error."""
    return [float(sum(m["role"] == "tool" and "error" in m["content"] for m in c)) for c in completions]


CALCULATIONS: list[str] = []  # every expression calculator computed
CRASH = {"once": False}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, counting the calls.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 5"
    """
    CALCULATIONS.append(expression)
    return agentic.calculator(expression)


def crashing_tool_failures(completions, **kwargs) -> list[float]:
    """tool_failures, but the first call stops the stage (after its episodes were sampled)."""
    if CRASH["once"]:
        CRASH["once"] = False
        raise RuntimeError("the machine went down")
    return tool_failures(completions)


def overrides(run_dir, model_dir) -> list[str]:
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "data.size=8", "data.prompts_per_step=2",
            "rollout.max_new_tokens=8", "drafter.enabled=false", "optim.lr=1e-3", "eval.every=0",
            "reward.function=varied_rewards:code_parity"]


def one_step(cfg) -> tuple:
    run = preflight(cfg)
    for stage in (stages.sample_prompts, stages.generate_trees, stages.cache_prefixes, stages.train_policy):
        stage(run, 0)
    manifests = {name: run.manifest(0, name) for name in ("prompts", "trees", "prefixes", "policy")}
    return run, load_trees(run, 0)[0], step_record(0, manifests)


def environment_segments(tokenizer, record: dict, leaf: int) -> list[str]:
    """The decoded runs of a leaf's tokens that the model did not sample."""
    runs, current = [], []
    for token, sampled in zip(record["completions"][leaf], record["sampled"][leaf]):
        if not sampled:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return [tokenizer.decode(r) for r in runs + ([current] if current else [])]


def test_an_environment_that_answers_trains_branching_per_turn_and_resumes(talkative_model_dir, tmp_path):
    cfg = load_config(None, [*overrides(tmp_path / "run", talkative_model_dir), "rollout.branching=[4,2]",
                             "rollout.branch_at=turns", "rollout.segment_tokens=[]", "rollout.max_turns=3",
                             "rollout.environment=lsreplay.data.agentic.ArithmeticFeedback",
                             "rollout.turn_barrier=true"])  # the HF engine's episodes bit-reproducible
    run, records, metrics = one_step(cfg)
    tokenizer = AutoTokenizer.from_pretrained(talkative_model_dir, local_files_only=True)
    for record in records:
        assert sum(record["counts"]) == 8 and len(record["sampled"]) == len(record["completions"])
        for leaf, turns in enumerate(record["turns"]):
            assert environment_segments(tokenizer, record, leaf) == [FEEDBACK] * (turns - 1)
            assert all(lp == 0.0 for lp, f in zip(record["logprobs"][leaf], record["sampled"][leaf]) if not f)
        assert record["reward_functions"]["environment"] and "code_parity" in record["reward_functions"]
    assert max(t for r in records for t in r["turns"]) >= 2  # some episodes were told to try again
    assert 1 < metrics["episodes/turns_mean"] <= 3 and 0 < metrics["episodes/environment_token_share"] < 1
    assert metrics["episodes/tool_calls_mean"] == 0 and metrics["episodes/tool_error_share"] == 0
    assert metrics["grad_norm"] > 0 and "rewards/environment/mean" in metrics
    # Each episode's KV kept between turns: the engine read each turn's new tokens, not its history again.
    assert 0 < metrics["episodes/prefill_positions"] < metrics["episodes/history_positions"]

    # Cut off after the shard's records were written, before its done marker: sampled again, the same.
    (tmp_path / "run/step_0000/trees-shard0.done.json").unlink()
    (tmp_path / "run/step_0000/trees.done.json").unlink()
    stages.generate_trees(run, 0)
    assert load_trees(run, 0)[0] == records


def test_a_model_calling_the_calculator_trains_on_its_calls_and_their_errors(tool_calling_model_dir, tmp_path):
    """And a trees stage that stopped after its episodes ran resumes without calling the tool
    again: their answers are read from the stage's journal."""
    cfg = load_config(None, [*overrides(tmp_path / "run", tool_calling_model_dir), "rollout.branching=[3,2]",
                             "rollout.branch_at=turns", "rollout.segment_tokens=[]", "rollout.max_turns=3",
                             "rollout.tools=[test_episode_flow.calculator]", "rollout.turn_barrier=true",
                             "reward.function=test_episode_flow:crashing_tool_failures",
                             # Dr. GRPO: its normaliser is the episode's budget of model tokens (3 x 8), which the
                             # 12 the model writes over 3 turns pass max_new_tokens (8) but not
                             "algo.loss_agg=seq-mean-token-sum-norm", "algo.scale_rewards=none"])
    CALCULATIONS.clear()
    CRASH["once"] = True
    run = preflight(cfg)
    stages.sample_prompts(run, 0)
    with pytest.raises(Exception, match="the machine went down"):
        stages.generate_trees(run, 0)
    calls = len(CALCULATIONS)
    assert calls > 0 and run.store.list("step_0000/trees/journal_00")
    run, records, metrics = one_step(cfg)
    assert len(CALCULATIONS) == calls  # read from the journal, not called again
    assert sum(n for r in records for n in r["tool_calls"]) >= calls and not run.store.list(
        "step_0000/trees/journal_00")
    tokenizer = AutoTokenizer.from_pretrained(tool_calling_model_dir, local_files_only=True)
    # SmolLM2's template ignores tools=: they are described in the system message.
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in tokenizer.decode(records[0]["prompt_ids"])
    results = {"3": "7", "5": "9", "x": "{'error': 'not arithmetic: x'}"}
    for record in records:
        for leaf, text in enumerate(record["texts"]):
            # Every reply is a call; the last one's is not run (no turn left to read its result).
            assert record["turns"][leaf] == 3 and record["tool_calls"][leaf] == 2
            operands = [part[0] for part in text.split('"expression": "')[1:]]
            assert environment_segments(tokenizer, record, leaf) == [
                f"\n<|im_start|>tool\n{results[o]}<|im_end|>\n<|im_start|>assistant\n" for o in operands[:2]]
            assert record["tool_errors"][leaf] == operands[:2].count("x")
    assert metrics["episodes/turns_mean"] == 3 and metrics["episodes/tool_calls_mean"] == 2
    # Lengths count the model's tokens: 4 per reply (the call's head, its operand, its tail, end-of-turn).
    assert metrics["completions/max_length"] == 12 < min(len(c) for r in records for c in r["completions"])
    assert 0 < metrics["episodes/tool_error_share"] < 1 and 0 < metrics["episodes/environment_token_share"] < 1
    assert metrics["grad_norm"] > 0
    assert json.dumps(records)  # the records stay JSON
