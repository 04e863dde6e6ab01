"""Stage 2: sample each prompt's rollouts as a tree and score them."""

from __future__ import annotations

import math
import posixpath
import tempfile
import time
from pathlib import Path
from collections.abc import Callable

from tqdm.auto import tqdm

from lsreplay import faults
from lsreplay.data import Prompt
from lsreplay.drafter.model import Drafter
from lsreplay.metrics import rollout_metrics
from lsreplay.models import eos_ids, load_tokenizer
from lsreplay.rendering import render_prompt
from lsreplay.rewards import Reward
from lsreplay.rollout.sampling import SamplingParams
from lsreplay.rollout.bandit import DraftLengthBandit
from lsreplay.rollout.tree_sampler import Speculation, length_summary, sample_trees
from lsreplay.resident import RESIDENT
from lsreplay.run import Run
from lsreplay.stages.common import StateClock, leaf_counts, policy_before
from lsreplay.stages.drafter import load_drafter, newest_drafter


def shard_name(shard: int) -> str:
    """The stage name of one rollout shard (its done marker: step_N/trees-shard0.done.json)."""
    return f"trees-shard{shard}"


def generate_trees(run: Run, step: int) -> dict:
    """The whole stage in this process: every shard in turn, then collected (scripts, tests)."""
    for shard in range(run.cfg.rollout.shards):
        generate_tree_shard(run, step, shard)
    return collect_trees(run, step)


def generate_tree_shard(run: Run, step: int, shard: int, progress: Callable[[float], None] | None = None,
                        devices: list[int] | None = None) -> dict:
    """Sample the trees of prompts shard, shard + shards, ... of the step (each with its own
    generator, so the draws do not depend on the sharding). `progress`, if given, is called
    with the fraction of the shard's token budget sampled so far; `devices`: the pool slot held."""
    if done := run.done(step, shard_name(shard)):
        return done
    run.begin(step, "trees")
    cfg, r = run.cfg, run.cfg.rollout
    key = run.key(step, "prompts.json")
    with run.reading(step, "prompts"):
        stored = run.store.read_json(key, sha256=run.sha256(run.manifest(step, "prompts"), key))
    indices = list(range(shard, len(stored["prompts"]), r.shards))
    prompts = [Prompt(**stored["prompts"][i]) for i in indices]
    device, clock = run.device(devices), StateClock()
    model, tokenizer, reward = clock(policy_before, run, step, device), load_tokenizer(cfg.model), Reward(cfg)
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    prompt_ids = [render_prompt(tokenizer, p, cfg.data) for p in prompts]
    start = time.perf_counter()
    with tqdm(total=len(prompts) * math.prod(r.branching) * r.max_new_tokens, desc=f"step {step} rollouts",
              unit="tok", leave=False) as bar:

        def advance(tokens: int) -> None:
            bar.update(tokens)
            if progress is not None:
                progress(min(bar.n / bar.total, 1.0) if bar.total else 1.0)

        if r.engine == "vllm":
            trees, summary, drafter_step = engine_rollouts(run, step, device, prompt_ids, eos_ids(tokenizer, model),
                                                           advance, clock)
        else:
            speculation, drafter_step = adaptive_engine(run, step, shard, model)
            trees, trace = sample_trees(
                model, prompt_ids, list(r.branching), list(r.segment_tokens), r.max_new_tokens, params,
                eos_ids(tokenizer, model), [run.generator(step, "trees", i, device=device) for i in indices], advance,
                speculation=speculation)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(1.0)  # every rollout ended (most before the token budget)
    records = tree_records(tokenizer, prompts, trees, reward, step)
    entry = run.store.write_json(run.key(step, "trees", f"shard_{shard:02d}.json"),
                                 {"prompt_indices": indices, "trees": records})
    lengths = [len(c) for rec in records for c in rec["completions"]]
    if r.engine == "vllm":
        summary = {**length_summary(lengths), **summary}
        decisions = {"drafter_step": drafter_step, "engine": summary}
    else:  # every decode step's decision (plain or speculative, draft length, live sequences, time)
        summary = trace.summary(lengths)
        decisions = {"drafter_step": drafter_step, "decisions": trace.decisions()}
    decisions = run.store.write_json(run.key(step, "trees", f"decisions_{shard:02d}.json"), decisions)
    faults.hook("trees", step, "mid")
    return run.finish(step, shard_name(shard), {
        "files": [entry, decisions], "shard": shard, "devices": devices, "device": str(device),
        "engine": r.engine, "drafter_step": drafter_step,
        "forward_positions": sum(t.forward_positions for t in trees), "completion_tokens": sum(lengths),
        "seconds": seconds, "state_seconds": clock.seconds, **summary})


def adaptive_engine(run: Run, step: int, shard: int, model) -> tuple[Speculation | None, int | None]:
    """The long-tail engine and the step of the drafter it uses: the newest trained one up
    to step - 2's (step - 1's is training alongside these rollouts). None before there is
    one, or when rollout.spec_threshold = 0 or the drafter is disabled."""
    r = run.cfg.rollout
    if r.spec_threshold == 0 or not run.cfg.drafter.enabled or step < 2:
        return None, None
    if (source := newest_drafter(run, step - 2)) is None:
        return None, None
    drafter = load_drafter(run, source, Drafter.from_target(model))
    bandit = DraftLengthBandit(arms=r.draft_lens, seed=run.seed(step, "bandit", shard))
    return Speculation(drafter, r.spec_threshold, bandit), source


def engine_rollouts(run: Run, step: int, device, prompt_ids: list[list[int]], eos: list[int], advance,
                    clock: StateClock) -> tuple[list, dict, int | None]:
    """The shard's trees sampled by this device's vLLM engine (rollout.engine=vllm), which
    holds the policy acting in `step` and speculates in the tail with the same drafter the
    HF engine would use (`newest_drafter` up to step - 2). Returns the trees, the decode
    summary (the HF engine's keys: the speculative figures from vLLM's counters, accept_len
    tokens per sequence per verify) and the drafter's step."""
    r = run.cfg.rollout
    source = None
    if r.spec_threshold and max(r.draft_lens) and run.cfg.drafter.enabled and step >= 2:
        source = newest_drafter(run, step - 2)
    drafter = None if source is None else (source, local_folder(run, f"{run.checkpoint('drafter', source)}/hf"))
    engine = clock(RESIDENT.engine, run, step, device, drafter)
    before = engine.spec_counters()
    trees, figures = engine.sample_trees(prompt_ids, list(r.branching), list(r.segment_tokens), r.max_new_tokens,
                                         r.temperature, r.top_p, r.top_k, eos, advance)
    after = engine.spec_counters()
    drafts, accepted = (after.get(k, 0) - before.get(k, 0) for k in ("drafts", "accepted_tokens"))
    spec = {"spec_rounds": drafts, "spec_tokens": drafts + accepted,
            "accept_len": (drafts + accepted) / drafts if drafts else 0.0, "spec_time_share": 0.0}
    return trees, {**figures, **spec}, source


def local_folder(run: Run, prefix: str) -> str:
    """A local folder holding the store's files under `prefix` (itself, in a local store)."""
    if run.store.local:
        return run.store.url(prefix)
    folder = Path(tempfile.mkdtemp(prefix="lsreplay-drafter-"))
    for key in run.store.sizes(prefix):
        (folder / posixpath.relpath(key, prefix)).write_bytes(run.store.read_bytes(key))
    return str(folder)


def collect_trees(run: Run, step: int) -> dict:
    """Join the finished shards into the step's trees.json, in prompt order (the stage's output)."""
    if done := run.done(step, "trees"):
        return done
    shards = [run.manifest(step, shard_name(k)) for k in range(run.cfg.rollout.shards)]
    by_prompt = {}
    for manifest in shards:
        key = manifest["files"][0]["key"]
        with run.reading(step, shard_name(manifest["shard"])):
            stored = run.store.read_json(key, sha256=run.sha256(manifest, key))
        by_prompt.update(zip(stored["prompt_indices"], stored["trees"]))
    records = [by_prompt[i] for i in sorted(by_prompt)]
    entry = run.store.write_json(run.key(step, "trees.json"), {"trees": records})
    lengths = [len(c) for rec in records for c in rec["completions"]]
    # Shards run side by side: the stage took from the first start to the last end.
    seconds = max(m["ended"] for m in shards) - min(m["started"] for m in shards)
    return run.finish(step, "trees", {
        "files": [entry], "trees": len(records), "rollouts": len(lengths), **group_stats(records),
        **rollout_metrics(records, run.cfg.rollout.max_new_tokens),
        "completion_tokens": sum(lengths),
        "forward_positions": sum(m["forward_positions"] for m in shards), "seconds": seconds,
        "tokens_per_s": sum(lengths) / seconds, "started": min(m["started"] for m in shards),
        "ended": max(m["ended"] for m in shards), **combine_traces(shards, lengths),
        "state_seconds": sum(m.get("state_seconds", 0.0) for m in shards),
        "shards": [{k: m[k] for k in ("shard", "devices", "started", "ended", "seconds")} for m in shards]})


def tree_records(tokenizer, prompts: list[Prompt], trees, reward: Reward, step: int) -> list[dict]:
    """What the store keeps of each tree: tokens, behaviour logprobs, texts, rewards (and each
    reward function's values: one batch of the shard's completions, as TRL scores them), and
    the samples each leaf stands for (its count, and its path through the branch points)."""
    texts = [[tokenizer.decode(c, skip_special_tokens=True) for c in tree.completions] for tree in trees]
    rewards, by_function = reward.score(prompts, texts, [tree.completions for tree in trees], step)
    return [{"prompt_index": prompt.index, "prompt_ids": tree.prompt_ids, "completions": tree.completions,
             "logprobs": tree.logprobs, "finished": tree.finished, "texts": texts[i], "rewards": rewards[i],
             "reward_functions": {name: values[i] for name, values in by_function.items()},
             "counts": tree.counts, "paths": tree.paths}
            for i, (prompt, tree) in enumerate(zip(prompts, trees))]


def group_stats(records: list[dict]) -> dict:
    """The step's mean reward over the samples the leaves stand for (an unbiased estimate of
    the policy's expected reward), and what the tree shape saves and costs, per tree on
    average: leaves sampled, the group size G they stand for, and the effective group size
    (sum n)^2 / sum n^2 of the counts n: G when no leaf ended before a branch point, less
    as copies of a leaf replace independent samples."""
    counts = [leaf_counts(rec) for rec in records]
    samples = sum(map(sum, counts))
    return {"reward_mean": sum(n * r for rec, ns in zip(records, counts) for n, r in zip(ns, rec["rewards"])) / samples,
            "leaves_per_tree": sum(map(len, counts)) / len(records), "group_size": samples / len(records),
            "effective_group_size": sum(sum(ns) ** 2 / sum(n * n for n in ns) for ns in counts) / len(records)}


def combine_traces(shards: list[dict], lengths: list[int]) -> dict:
    """The shards' decode summaries as one: the length distribution over all rollouts, times
    and counts summed, shares of decode time weighted by each shard's decode time, and
    accept_len as tokens per sequence-verification over all speculative rounds."""
    decode = [m["decode_seconds"] for m in shards]
    total = sum(decode) or 1e-9

    def share(key: str) -> float:
        return sum(m[key] * s for m, s in zip(shards, decode)) / total

    spec_tokens = sum(m["spec_tokens"] for m in shards)
    verify_rows = sum(m["spec_tokens"] / m["accept_len"] for m in shards if m["accept_len"])
    return {**length_summary(lengths), "decode_seconds": sum(decode),
            "decode_steps": sum(m["decode_steps"] for m in shards), "tail_time_share": share("tail_time_share"),
            "spec_rounds": sum(m["spec_rounds"] for m in shards), "spec_tokens": spec_tokens,
            "accept_len": spec_tokens / verify_rows if verify_rows else 0.0,
            "spec_time_share": share("spec_time_share")}

