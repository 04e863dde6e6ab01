"""Stage 2: sample each prompt's rollouts as a tree and score them."""

from __future__ import annotations

import contextlib
import logging
import math
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm.auto import tqdm

from lsreplay.algos.model_tokens import sampled_flags
from lsreplay.core import faults
from lsreplay.core.config import multi_turn
from lsreplay.core.run import Run
from lsreplay.data.chat_formats import Chat
from lsreplay.data.environments import Calls, Episode, Episodes, load_play
from lsreplay.data.preferences import Preference, offline, preference_record
from lsreplay.data.rendering import render_prompt
from lsreplay.data.rewards import Reward
from lsreplay.data.sources import Prompt
from lsreplay.drafter.model import Drafter
from lsreplay.metrics.records import episode_metrics, rollout_metrics
from lsreplay.models.loading import eos_ids, load_tokenizer
from lsreplay.rollout.bandit import DraftLengthBandit
from lsreplay.rollout.episodes import sample_episodes
from lsreplay.rollout.hf_turns import HFTurns
from lsreplay.rollout.vllm_turns import VLLMTurns
from lsreplay.rollout.tree_sampler import Speculation, length_summary, sample_trees
from lsreplay.stages.common import (StateClock, all_alike, filter_values, leaf_counts, records_in_prompt_order,
                                    sampled_as, training_rewards)
from lsreplay.stages.drafter import load_drafter, newest_drafter
from lsreplay.stages.trainer_state import tokens_seen, trainer_state
from lsreplay.stages.versions import sampling_version
from lsreplay.state.resident import RESIDENT

log = logging.getLogger(__name__)


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
    generator, so the draws do not depend on the sharding) with the policy version the step
    samples with (stages.versions; recorded in every tree's record). `progress`, if given,
    is called with the fraction of the shard's token budget sampled so far; `devices`: the
    pool slot held.

    Dynamic sampling: a tree whose leaves all score alike (algo.dynamic_sampling_metric) is replaced by the tree of
    the prompt the prompts stage drew for its place in the next round (with a generator of
    its own), up to algo.dynamic_sampling_draws rounds; a place out of draws keeps its last."""
    if done := run.done(step, shard_name(shard)):
        return done
    run.begin(step, "trees")
    cfg, r = run.cfg, run.cfg.rollout
    key = run.key(step, "prompts.json")
    with run.reading(step, "prompts"):
        stored = run.store.read_json(key, sha256=run.sha256(run.manifest(step, "prompts"), key))
    if offline(cfg):
        return _preference_shard(run, step, shard, stored["preferences"], devices)
    indices = list(range(shard, len(stored["prompts"]), r.shards))
    device, clock, version = run.device(devices), StateClock(), sampling_version(cfg, step)
    span = tuple(run.device([d]) for d in devices) if devices else (device,)  # a tensor-parallel vLLM engine's
    model, tokenizer = clock(RESIDENT.sampler, run, version, device), load_tokenizer(cfg.model)
    reward = Reward(cfg, device)
    state = trainer_state(run, step)
    draws = cfg.algo.dynamic_sampling_draws if cfg.algo.dynamic_sampling else 1
    records, rounds, pending, logged, start = {}, [], indices, {}, time.perf_counter()
    # The HF engine decodes episodes without its speculative tail (vLLM speculates in each turn's).
    speculates = r.engine == "hf" and not multi_turn(r)
    speculation, drafter_step = adaptive_engine(run, step, shard, model) if speculates else (None, None)
    # The token budget: every rollout's replies at their longest (the environment's tokens are not sampled).
    budget = len(indices) * math.prod(r.branching) * r.max_turns * r.max_new_tokens
    with tqdm(total=budget, desc=f"step {step} rollouts", unit="tok", leave=False) as bar, \
            contextlib.ExitStack() as stack:
        if r.engine == "vllm":  # the engine holds this version until the shard's last request
            stack.enter_context(RESIDENT.serving(device, version))
        # Episodes' tool and environment calls: one event loop and one pool for the stage.
        calls = stack.enter_context(Calls(r.tool_timeout_seconds, episode_workers(r))) if multi_turn(r) else None

        def advance(tokens: int) -> None:
            bar.update(tokens)
            if progress is not None:
                progress(min(bar.n / bar.total, 1.0) if bar.total else 1.0)

        for draw in range(draws):
            prompts = [Prompt(**(stored["prompts"] if draw == 0 else stored["reserve"][draw - 1])[i]) for i in pending]
            trees, figures, decisions, drafter_step, episodes = _sample(
                run, step, device, model, tokenizer, prompts, pending, draw, advance, clock, speculation, drafter_step,
                calls, shard, span)
            try:
                scored, metrics = tree_records(tokenizer, prompts, trees, reward, state, episodes)
            finally:
                if episodes is not None:
                    episodes.close()
            records.update(zip(pending, scored))
            for name, values in metrics.items():  # what the reward functions gave log_metric
                logged.setdefault(name, []).extend(values)
            rounds.append({"figures": figures, "decisions": decisions, "prompts": len(pending),
                           "forward_positions": sum(t.forward_positions for t in trees),
                           "lengths": model_lengths(trees)})
            pending = [i for i in pending if all_alike(filter_values(cfg, records[i]))]
            if not pending:
                break
    if cfg.rollout.engine == "vllm":
        RESIDENT.rest_engine(device)  # on CUDA: the device's memory to the caching pass and the update
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(1.0)  # every rollout ended (most before the token budget)
    if cfg.algo.dynamic_sampling and pending:
        log.warning("step %d shard %d: %d trees still had leaves all alike on %s after %d rounds of draws "
                    "(algo.dynamic_sampling_draws); the loss leaves them out", step, shard, len(pending),
                    cfg.algo.dynamic_sampling_metric, draws)
    records = [{**records[i], "policy_version": version} for i in indices]
    entry = run.store.write_json(run.key(step, "trees", f"shard_{shard:02d}.json"),
                                 {"prompt_indices": indices, "trees": records})
    lengths = [n for rnd in rounds for n in rnd["lengths"]]
    summary = combine_traces([rnd["figures"] for rnd in rounds], lengths)
    cache = {}
    if r.engine == "vllm":  # the prompt positions vLLM's prefix cache served, of those it was sent
        cache = {k: sum(rnd["figures"][k] for rnd in rounds) for k in ("prompt_positions", "cached_positions")}
        decisions = {"drafter_step": drafter_step, "engine": summary}
    else:  # every decode step's decision (plain or speculative, draft length, live sequences, time)
        decisions = {"drafter_step": drafter_step, "decisions": [d for rnd in rounds for d in rnd["decisions"]]}
    decisions = run.store.write_json(run.key(step, "trees", f"decisions_{shard:02d}.json"), decisions)
    faults.hook("trees", step, "mid")
    done = run.finish(step, shard_name(shard), {
        "files": [entry, decisions], "shard": shard, "devices": devices, "device": str(device),
        "engine": r.engine, "policy_version": version, "drafter_step": drafter_step,
        "forward_positions": sum(rnd["forward_positions"] for rnd in rounds), "completion_tokens": sum(lengths),
        "prompts_drawn": sum(rnd["prompts"] for rnd in rounds), "seconds": seconds, "state_seconds": clock.seconds,
        "logged": logged, **summary, **cache, **episode_figures(rounds)})
    if multi_turn(r):  # the shard's episodes stand: their answers are in
        run.store.delete_prefix(journal_folder(run, step, shard))
    return done


def _sample(run: Run, step: int, device, model, tokenizer, prompts: list[Prompt], slots: list[int], draw: int,
            advance, clock: StateClock, speculation: Speculation | None, drafter_step: int | None,
            calls: Calls | None, shard: int, span: tuple = ()):
    """One round of the shard's rollouts: the trees of `prompts` (the step's places `slots`,
    in round `draw`), the decode figures (combine_traces' keys), the decode decisions (HF
    engine), the drafter's step, and for episodes their outcomes (else None). `span`: the
    devices the shard holds, `device` first (a vLLM engine spans them all)."""
    cfg, r = run.cfg, run.cfg.rollout
    if multi_turn(r):
        return _episode_round(run, step, device, model, tokenizer, prompts, slots, draw, advance, clock, calls, shard,
                              span)
    prompt_ids = [render_prompt(tokenizer, p, cfg.data) for p in prompts]
    if r.engine == "vllm":
        trees, figures, drafter_step = engine_rollouts(run, step, device, prompt_ids, eos_ids(tokenizer, model),
                                                       advance, clock, span)
        return (trees, {**length_summary([len(c) for t in trees for c in t.completions]), **figures}, [], drafter_step,
                None)
    generators = [run.generator(step, "trees", i, *([draw] if draw else []), device=device) for i in slots]
    trees, trace = sample_trees(model, prompt_ids, list(r.branching), list(r.segment_tokens), r.max_new_tokens,
                                sampled_as(cfg), eos_ids(tokenizer, model), generators, advance, speculation=speculation)
    return trees, trace.summary([len(c) for t in trees for c in t.completions]), trace.decisions(), drafter_step, None


@dataclass
class EpisodeOutcomes:
    """A round's ended episodes (per tree, per leaf: lsreplay.data.environments.Episode), the
    prompts as reward functions see them (the reset strings appended), and whether the
    environment scores its episodes (get_reward)."""

    episodes: list[list[Episode]]
    prompts: list[Prompt]
    rewards: bool
    closing: Callable[[Episode], None]

    def close(self) -> None:
        """Every ended episode's environment closed (after its reward functions saw it)."""
        for episodes in self.episodes:
            for episode in episodes:
                self.closing(episode)


def episode_workers(r) -> int:
    """Threads for the episodes' environment side: one per episode in flight, within reason."""
    return r.max_concurrent_episodes or 64


def _episode_round(run: Run, step: int, device, model, tokenizer, prompts: list[Prompt], slots: list[int], draw: int,
                   advance, clock: StateClock, calls: Calls, shard: int, span: tuple = ()):
    """One round of episodes (rollout.max_turns, tools, an environment: lsreplay.data.environments),
    as _sample returns a round: the decode figures are the round's wall time (the tools' and
    the environment's included; no decode trace), the engine's counters (the HF engine's
    prefill and decode positions; vLLM's prefix cache, summed over the requests, and its
    speculation) and the positions re-reading each turn's history would have prefilled."""
    cfg, r = run.cfg, run.cfg.rollout
    eos = eos_ids(tokenizer, model)
    play = load_play(r, cfg.sandbox)
    episodes = Episodes(play, Chat(tokenizer, play.schemas, cfg.data, eos, play.format), prompts, calls,
                        StoreJournal(run, step, shard, draw))
    draws = [draw] if draw else []

    def generator_for(tree: int, path: tuple[int, ...], turn: int):
        # Turn 0 draws as a single-turn tree would; later turns per episode ("turn" keeps the keys apart).
        return run.generator(step, "trees", slots[tree], *draws, *(["turn", turn, *path] if turn else []),
                             device=device)

    drafter_step, engine = None, None
    try:
        if r.engine == "vllm":
            engine, drafter_step = device_engine(run, step, device, clock, span)
            before = engine.spec_counters()
            turns = VLLMTurns(engine, r.max_new_tokens, r.temperature, r.top_p, r.top_k, eos,
                              engine_progress(step, engine, advance))
        else:
            turns = HFTurns(model, r.max_new_tokens, sampled_as(cfg), eos, generator_for, advance)
        start = time.perf_counter()
        with turns:
            trees, counters = sample_episodes(turns, episodes.prompt_ids(), list(r.branching), r.max_turns, episodes,
                                              list(r.segment_tokens) if r.branch_at == "tokens" else None, calls.pool,
                                              r.max_concurrent_episodes, r.turn_barrier)
    except BaseException:
        for tree in range(len(prompts)):  # the sampler closes what it holds; not the roots it never took
            episodes.close(episodes.root(tree))
        raise
    figures = {**length_summary(model_lengths(trees)),
               "decode_seconds": time.perf_counter() - start, "decode_steps": counters.get("decode_steps", 0),
               "tail_time_share": 0.0, "spec_rounds": 0, "spec_tokens": 0, "accept_len": 0.0, "spec_time_share": 0.0,
               "episode_counters": counters}
    if engine is not None:  # the prefix cache's figures and the speculation, over every request
        figures.update({k: counters[k] for k in ENGINE_COUNTS}, **speculated(engine, before))
    outcomes = EpisodeOutcomes([list(t.episodes) for t in trees], episodes.reward_prompts(), play.rewards,
                               episodes.close)
    return trees, figures, [], drafter_step, outcomes


class StoreJournal:
    """The environment's answers of one round of a shard's episodes in the run's store, one
    entry per answer (trees/journal_SS/DRAW/KEY.json), written as given and read by a stage
    that resumes (lsreplay.data.environments.Journal); deleted once the shard is done."""

    def __init__(self, run: Run, step: int, shard: int, draw: int):
        self.store, self.folder = run.store, f"{journal_folder(run, step, shard)}/{draw}"
        self.recorded = {posixpath.basename(k).removesuffix(".json"): k for k in self.store.list(self.folder)}
        if self.recorded:
            log.info("step %d shard %d: %d answers of the environment recorded by an interrupted trees stage; "
                     "the tools' are read, not called again", step, shard, len(self.recorded))

    def get(self, key: str) -> dict | None:
        return self.store.read_json(self.recorded[key]) if key in self.recorded else None

    def put(self, key: str, entry: dict) -> None:
        self.store.write_json(f"{self.folder}/{key}.json", entry)


def journal_folder(run: Run, step: int, shard: int) -> str:
    return run.key(step, "trees", f"journal_{shard:02d}")


# The episodes' engine counters a shard's manifest holds (summed by collect_trees): the
# positions the HF engine prefilled (prompts, then each turn's new tokens; 0 on vLLM, whose
# prefix cache the trees' cached_positions count) and those re-reading each turn's history
# (prompt and episode so far) would have prefilled.
EPISODE_COUNTERS = ("prefill_positions", "history_positions")


def episode_figures(rounds: list[dict]) -> dict:
    """A shard's EPISODE_COUNTERS summed over its rounds, as episodes/NAME; none for
    single-turn rollouts."""
    counters = [rnd["figures"].get("episode_counters") for rnd in rounds]
    if not any(counters):
        return {}
    return {f"episodes/{k}": sum(c.get(k, 0) for c in counters if c) for k in EPISODE_COUNTERS}


def _preference_shard(run: Run, step: int, shard: int, rows: list[dict], devices) -> dict:
    """Offline DPO: the shard's trees built from preference rows (lsreplay.data.preferences), no
    model and no rollouts; the decode figures are zeros."""
    cfg, start = run.cfg, time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    indices = list(range(shard, len(rows), cfg.rollout.shards))
    records = [preference_record(tokenizer, Preference(**rows[i]), cfg.data.max_prompt_tokens,
                                 cfg.rollout.max_new_tokens, cfg.data.chat_template_kwargs) for i in indices]
    entry = run.store.write_json(run.key(step, "trees", f"shard_{shard:02d}.json"),
                                 {"prompt_indices": indices, "trees": records})
    lengths = [len(c) for rec in records for c in rec["completions"]]
    decode = {"decode_seconds": 0.0, "decode_steps": 0, "tail_time_share": 0.0, "spec_rounds": 0, "spec_tokens": 0,
              "accept_len": 0.0, "spec_time_share": 0.0}
    faults.hook("trees", step, "mid")
    return run.finish(step, shard_name(shard), {
        "files": [entry], "shard": shard, "devices": devices, "device": "none", "engine": "dataset",
        "drafter_step": None, "forward_positions": 0, "completion_tokens": sum(lengths), "prompts_drawn": len(indices),
        "seconds": time.perf_counter() - start, **length_summary(lengths), **decode})


def rollout_drafter(run: Run, step: int) -> int | None:
    """The step of the drafter `step`'s rollouts speculate with: for rollouts sampled by
    policy version v (stages.versions; v = step when synchronous), the newest trained one up
    to step v - 2's (step v - 1's trains alongside the first rollouts of version v, and
    shares its embedding and head with version v); None before there is one."""
    version = sampling_version(run.cfg, step)
    return newest_drafter(run, version - 2) if version >= 2 else None


def adaptive_engine(run: Run, step: int, shard: int, model) -> tuple[Speculation | None, int | None]:
    """The long-tail engine and the step of the drafter it uses (`rollout_drafter`). None
    before there is one, or when rollout.spec_threshold = 0 or the drafter is disabled."""
    r = run.cfg.rollout
    if r.spec_threshold == 0 or not run.cfg.drafter.enabled or (source := rollout_drafter(run, step)) is None:
        return None, None
    drafter = load_drafter(run, source, Drafter.from_target(model))
    bandit = DraftLengthBandit(arms=r.draft_lens, seed=run.seed(step, "bandit", shard))
    return Speculation(drafter, r.spec_threshold, bandit), source


# The vLLM engine's figures of a call that add up over calls (VLLMEngine.sample_trees).
ENGINE_COUNTS = ("decode_steps", "prompt_positions", "cached_positions", "generated_positions")


def device_engine(run: Run, step: int, device, clock: StateClock, span: tuple = ()):
    """This device's vLLM engine (rollout.engine=vllm; with tensor parallelism spanning the
    devices `span`, this one first), holding the policy version that samples `step` and
    speculating in the tail with the drafter the HF engine would use (`adaptive_engine`),
    and that drafter's step (None: none)."""
    r = run.cfg.rollout
    source = rollout_drafter(run, step) if r.spec_threshold and max(r.draft_lens) and run.cfg.drafter.enabled else None
    with contextlib.ExitStack() as copies:  # the engine has read the drafter's files when it returns
        drafter = None if source is None else \
            (source, copies.enter_context(run.store.local_folder(f"{run.checkpoint('drafter', source)}/hf")))
        return clock(RESIDENT.engine, run, sampling_version(run.cfg, step), device, drafter, span), source


def engine_progress(step: int, engine, advance) -> Callable[[int], None]:
    """The engine's progress messages: the bar advanced, and the injected engine faults' hook."""
    def progress(tokens: int) -> None:
        faults.engine_call("trees", step, engine.pid)
        advance(tokens)

    return progress


def speculated(engine, before: dict) -> dict:
    """The engine's speculative figures since its counters read `before` (the HF engine's keys;
    accept_len: tokens per sequence per verify)."""
    after = engine.spec_counters()
    drafts, accepted = (after.get(k, 0) - before.get(k, 0) for k in ("drafts", "accepted_tokens"))
    return {"spec_rounds": drafts, "spec_tokens": drafts + accepted,
            "accept_len": (drafts + accepted) / drafts if drafts else 0.0, "spec_time_share": 0.0}


def engine_rollouts(run: Run, step: int, device, prompt_ids: list[list[int]], eos: list[int], advance,
                    clock: StateClock, span: tuple = ()) -> tuple[list, dict, int | None]:
    """The shard's trees sampled by this device's vLLM engine (device_engine). Returns the
    trees, the decode summary (the HF engine's keys, the speculative figures from vLLM's
    counters) and the drafter's step."""
    r = run.cfg.rollout
    engine, source = device_engine(run, step, device, clock, span)
    before = engine.spec_counters()
    trees, figures = engine.sample_trees(prompt_ids, list(r.branching), list(r.segment_tokens), r.max_new_tokens,
                                         r.temperature, r.top_p, r.top_k, eos, engine_progress(step, engine, advance))
    return trees, {**figures, **speculated(engine, before)}, source


def model_lengths(trees) -> list[int]:
    """Each rollout's tokens the model sampled (an episode's replies; not the environment's)."""
    return [sum(flags) for t in trees for flags in getattr(t, "sampled", None) or [[True] * len(c)
                                                                                  for c in t.completions]]


def collect_trees(run: Run, step: int) -> dict:
    """The step's trees are its finished shards' (the stage's output): the manifest lists
    their files, which later stages read in prompt order (stages.common.load_trees). Each
    tree is written once, by its shard."""
    if done := run.done(step, "trees"):
        return done
    shards = [run.manifest(step, shard_name(k)) for k in range(run.cfg.rollout.shards)]
    files = [manifest["files"][0] for manifest in shards]
    records = records_in_prompt_order(run, step, [(f, shard_name(m["shard"])) for f, m in zip(files, shards)])
    lengths = [sum(flags) for rec in records for flags in sampled_flags(rec)]  # the model's tokens
    # Shards run side by side: the stage took from the first start to the last end.
    seconds = max(m["ended"] for m in shards) - min(m["started"] for m in shards)
    # Shards sampled before dynamic sampling drew one prompt per tree.
    drawn = sum(m.get("prompts_drawn", 0) for m in shards) if all("prompts_drawn" in m for m in shards) \
        else len(records)
    return run.finish(step, "trees", {
        "files": files, "trees": len(records), "rollouts": len(lengths), **group_stats(records),
        # Trees whose leaves all got the same reward: no GRPO gradient, no DPO pair. With
        # dynamic sampling, prompts_drawn - trees of the step's trees were dropped for that.
        "trees_all_alike": sum(all_alike(training_rewards(run.cfg, rec)) for rec in records),
        "prompts_drawn": drawn, "trees_dropped": drawn - len(records),
        "policy_version": min(m.get("policy_version", step) for m in shards),  # every shard's (stages.versions)
        **rollout_metrics(records, run.cfg.rollout.max_new_tokens), **episode_metrics(records),
        "num_tokens": tokens_seen(run, step) + sample_tokens(records), "logged": logged_means(shards),
        "completion_tokens": sum(lengths),
        "forward_positions": sum(m["forward_positions"] for m in shards), "seconds": seconds,
        "tokens_per_s": sum(m["completion_tokens"] for m in shards) / max(seconds, 1e-9), "started": min(m["started"] for m in shards),
        "ended": max(m["ended"] for m in shards), **combine_traces(shards, lengths),
        "state_seconds": sum(m.get("state_seconds", 0.0) for m in shards),
        **{f"episodes/{k}": sum(m[f"episodes/{k}"] for m in shards) for k in EPISODE_COUNTERS
           if all(f"episodes/{k}" in m for m in shards)},
        "shards": [{k: m[k] for k in ("shard", "devices", "started", "ended", "seconds")} for m in shards]})


def tree_records(tokenizer, prompts: list[Prompt], trees, reward: Reward, state,
                 outcomes: EpisodeOutcomes | None = None) -> tuple[list[dict], dict]:
    """What the store keeps of each tree: tokens, behaviour logprobs, texts, rewards (None
    where no reward function applies; each function's values: one batch of the shard's
    completions, as TRL scores them; the columns they logged), and the samples each leaf
    stands for (its count, and its path through the branch points). And the scalars the
    functions gave log_metric. Episodes add per leaf which tokens the model sampled, its
    turns, tool calls and tool errors; their rewards see the prompts with the reset strings,
    the messages (TRL-style functions; and the environments, TRL's `environments`) or the
    last reply (the others), and the environment's reward."""
    texts = [[tokenizer.decode(c, skip_special_tokens=True) for c in tree.completions] for tree in trees]
    if outcomes is None:
        scores = reward.score(prompts, texts, [tree.completions for tree in trees], state)
    else:
        episodes = outcomes.episodes
        scores = reward.score(outcomes.prompts, [[e.answer for e in es] for es in episodes],
                              [t.completions for t in trees], state, [[e.messages for e in es] for es in episodes],
                              [[e.reward for e in es] for es in episodes] if outcomes.rewards else None,
                              [[e.instance for e in es] for es in episodes] if any(e.instance is not None
                                                                                   for es in episodes for e in es)
                              else None)
    records = [{"prompt_index": prompt.index, "prompt_ids": tree.prompt_ids, "completions": tree.completions,
                "logprobs": tree.logprobs, "finished": tree.finished, "texts": texts[i], "rewards": scores.totals[i],
                "reward_functions": {name: values[i] for name, values in scores.by_function.items()},
                "extras": {column: values[i] for column, values in scores.extras.items()},
                "counts": tree.counts, "paths": tree.paths,
                **({} if outcomes is None else episode_fields(tree, episodes[i]))}
               for i, (prompt, tree) in enumerate(zip(prompts, trees))]
    return records, scores.metrics


def episode_fields(tree, episodes: list[Episode]) -> dict:
    """What a record keeps of a tree's episodes, per leaf: the model's tokens (algos.model_tokens.sampled_flags),
    its turns, tool calls and tool errors."""
    return {"sampled": tree.sampled, "turns": tree.turns, "tool_calls": [e.tool_calls for e in episodes],
            "tool_errors": [e.tool_errors for e in episodes]}


def sample_tokens(records: list[dict]) -> int:
    """Prompt and completion tokens of the samples a step's trees stand for (each leaf
    counted as its samples): TRL's num_tokens of one step."""
    return sum(n * (len(rec["prompt_ids"]) + len(c)) for rec in records
               for c, n in zip(rec["completions"], leaf_counts(rec)))


def logged_means(shards: list[dict]) -> dict[str, float]:
    """Each log_metric scalar's mean over the calls of every shard (TRL averages a logging
    step's calls)."""
    values: dict[str, list[float]] = {}
    for manifest in shards:
        for name, vs in manifest.get("logged", {}).items():
            values.setdefault(name, []).extend(vs)
    return {name: sum(vs) / len(vs) for name, vs in values.items()}


def group_stats(records: list[dict]) -> dict:
    """The step's mean reward over the samples the leaves stand for (an unbiased estimate of
    the policy's expected reward; unscorable samples left out, as in TRL), and what the tree shape saves and costs, per tree on
    average: leaves sampled, the group size G they stand for, and the effective group size
    (sum n)^2 / sum n^2 of the counts n: G when no leaf ended before a branch point, less
    as copies of a leaf replace independent samples."""
    counts = [leaf_counts(rec) for rec in records]
    samples = sum(map(sum, counts))
    scored = [(n, r) for rec, ns in zip(records, counts) for n, r in zip(ns, rec["rewards"]) if r is not None]
    return {"reward_mean": sum(n * r for n, r in scored) / max(sum(n for n, _ in scored), 1),
            "leaves_per_tree": sum(map(len, counts)) / len(records), "group_size": samples / len(records),
            "effective_group_size": sum(sum(ns) ** 2 / sum(n * n for n in ns) for ns in counts) / len(records)}


def combine_traces(shards: list[dict], lengths: list[int]) -> dict:
    """The shards' decode summaries as one: the length distribution over all rollouts, times
    and counts summed, shares of decode time weighted by each shard's decode time, accept_len
    as tokens per sequence-verification over all speculative rounds, and the most K/V bytes
    one shard's sampler held (the HF engine's; absent where no shard says)."""
    decode = [m["decode_seconds"] for m in shards]
    total = sum(decode) or 1e-9

    def share(key: str) -> float:
        return sum(m[key] * s for m, s in zip(shards, decode)) / total

    spec_tokens = sum(m["spec_tokens"] for m in shards)
    verify_rows = sum(m["spec_tokens"] / m["accept_len"] for m in shards if m["accept_len"])
    held = [m["kv_bytes_peak"] for m in shards if "kv_bytes_peak" in m]
    return {**({"kv_bytes_peak": max(held)} if held else {}), **length_summary(lengths), "decode_seconds": sum(decode),
            "decode_steps": sum(m["decode_steps"] for m in shards), "tail_time_share": share("tail_time_share"),
            "spec_rounds": sum(m["spec_rounds"] for m in shards), "spec_tokens": spec_tokens,
            "accept_len": spec_tokens / verify_rows if verify_rows else 0.0,
            "spec_time_share": share("spec_time_share")}

