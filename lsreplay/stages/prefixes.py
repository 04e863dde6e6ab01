"""Stage 3: the caching pass. One no-grad forward per tree records the K/V of every
branching node (for replay), every entry's logprob where a loss reads them, a critic's
value of every entry (PPO's old values), and every position's last hidden state where the
drafter trains, each tensor file with its sha256 in the manifest. The per-rollout baseline
instead runs every rollout's full sequence for the logprobs (and values).

The policy's own logprobs are scored only where a loss reads them (`scores_logprobs`): the
KL term, PPO's old logprobs, DPO's margins. With one GRPO update per batch, the update
starts from the parameters that would score them, so the ratio is exactly 1 and neither
the loss nor its per-token weights depend on their values (TRL skips this pass for the
same reason). Without them and the drafter, the pass visits the branching nodes only, and
the per-rollout baseline has nothing to compute. The frozen reference is scored for the
KL term and for DPO."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lsreplay.algos.backward import activations_kv, scores_of
from lsreplay.algos.model_tokens import sampled_flags
from lsreplay.core import faults
from lsreplay.core.run import Run
from lsreplay.core.storage import StorageError
from lsreplay.models.lora import adapters_off
from lsreplay.replay.capture import TreeActivations, capture_rollouts, capture_tree
from lsreplay.replay.heads import LOGPROB, Heads, logprob_heads
from lsreplay.replay.segments import PrefixKV
from lsreplay.distributed.context import ContextParallel
from lsreplay.replay.backward import replay_plan, splits
from lsreplay.replay.view import read_kv_nodes
from lsreplay.stages.common import StateClock, load_trees, policy_before, policy_heads, sampled_as, trains_nothing
from lsreplay.state.resident import RESIDENT

log = logging.getLogger(__name__)


def kv_key(run: Run, step: int, tree: int, node: int) -> str:
    return run.key(step, "prefix_kv", f"tree_{tree:03d}", f"node_{node:04d}.safetensors")


def activations_key(run: Run, step: int, tree: int) -> str:
    return run.key(step, "activations", f"tree_{tree:03d}.safetensors")


def kv_tensors(kv: PrefixKV) -> dict[str, torch.Tensor]:
    keys, values = kv
    return {**{f"k{i}": k for i, k in enumerate(keys)}, **{f"v{i}": v for i, v in enumerate(values)}}


def tensors_kv(tensors: dict[str, torch.Tensor]) -> PrefixKV:
    layers = len(tensors) // 2
    return [tensors[f"k{i}"] for i in range(layers)], [tensors[f"v{i}"] for i in range(layers)]


def activation_tensors(acts: TreeActivations) -> dict[str, torch.Tensor]:
    logprobs = {"entry_logprobs": acts.entry_logprobs, "ref_entry_logprobs": acts.ref_entry_logprobs}
    return {**{k: v for k, v in logprobs.items() if v is not None},
            **{f"entry_scores.{name}": v for name, v in acts.entry_scores.items()},
            **{f"hidden.{n}": h for n, h in acts.hidden.items()}}


def load_activations(run: Run, step: int, tree: int, manifest: dict) -> TreeActivations:
    """What the caching pass kept of tree `tree`: nothing (an empty TreeActivations) when
    no later stage reads anything of it."""
    entry = manifest["activations"][tree] if manifest["activations"] else None
    if entry is None:
        return TreeActivations()
    with run.reading(step, "prefixes"):
        tensors = run.store.read_tensors(entry["key"], sha256=entry["sha256"])
    hidden = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("hidden.")}
    scores = {k.removeprefix("entry_scores."): v for k, v in tensors.items() if k.startswith("entry_scores.")}
    return TreeActivations(entry_logprobs=tensors.get("entry_logprobs"), hidden=hidden,
                           ref_entry_logprobs=tensors.get("ref_entry_logprobs"), entry_scores=scores)


# replay.kv_offload = "host": the caching stage also keeps the K/V it wrote in this
# process's memory, keyed by sha256, so a backward in the same process skips reading
# them back. Keyed by content hash, an entry can only ever stand for what the manifest names.
HOST_KV: dict[str, PrefixKV] = {}


class StoredPrefixKV:
    """Prefix K/V read back from this process's memory or the store, verified, on `device`;
    None (recompute) if missing or corrupt."""

    def __init__(self, run: Run, manifest: dict, device: torch.device | str = "cpu"):
        self.run, self.entries, self.device = run, manifest["prefix_kv"], torch.device(device)

    def __call__(self, tree: int, node) -> PrefixKV | None:
        entry = self.entries[tree].get(str(node.id))
        if entry is None:
            log.warning("tree %d node %d: no cached prefix K/V in the manifest; recomputing it", tree, node.id)
            return None
        if entry["sha256"] in HOST_KV:
            keys, values = HOST_KV.pop(entry["sha256"])
        else:
            try:
                keys, values = tensors_kv(self.run.store.read_tensors(entry["key"], sha256=entry["sha256"]))
            except StorageError as e:
                log.warning("tree %d node %d: cached prefix K/V unusable (%s); recomputing it", tree, node.id, e)
                return None
        # From page-locked memory (replay.kv_offload=host, on a GPU) without waiting for the device.
        return ([k.to(self.device, non_blocking=True) for k in keys],
                [v.to(self.device, non_blocking=True) for v in values])


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: off a GPU into page-locked memory, which the backward's copy back
    (StoredPrefixKV) reads without waiting for the device; a CPU tensor as it is."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def _capture(run: Run, model, tree, heads: Heads, keep_hidden: bool, kv_nodes: set[int]) -> TreeActivations:
    """Branch replay's pass over the tree, every entry scored by `heads`, the K/V of
    `kv_nodes` kept; the per-rollout baseline (replay.mode=naive), as a per-rollout trainer
    does, scores every rollout's full sequence (the drafter's hidden states, if it is on,
    still come from a tree pass)."""
    if run.cfg.replay.mode == "replay":
        return capture_tree(model, tree, keep_hidden=keep_hidden, heads=heads, kv_nodes=kv_nodes)
    acts = capture_rollouts(model, tree, heads=heads) if heads else TreeActivations()
    if keep_hidden:
        acts.hidden = capture_tree(model, tree, heads={}, kv_nodes=set()).hidden
    return acts


def capture_now(run: Run, model, trees, heads: Heads):
    """The caching pass of the current weights over `trees`, kept in memory: (their scores,
    as a loss over `heads` takes them, and a prefix K/V source over them). PPO's later
    minibatches: the K/V replay reads wait in host memory (off a GPU, page-locked) until it does."""
    acts = [_capture(run, model, tree, heads, False, kv_read(run, model, tree)) for tree in trees]
    for a in acts:
        a.prefix_kv = {n: tuple([_host_copy(t) for t in half] for half in kv) for n, kv in a.prefix_kv.items()}
    scores = scores_of(trees, acts, heads)
    device = next(model.parameters()).device

    def source(index: int, node):
        kv = activations_kv(acts)(index, node)
        return None if kv is None else tuple([t.to(device, non_blocking=True) for t in half] for half in kv)

    return scores, source


def kv_read(run: Run, model, tree) -> set[int]:
    """The tree nodes whose K/V the replay backward will read: those of its branching spans
    it neither keeps the graph of nor runs layer by layer (replay_plan), none for the
    per-rollout baseline, nor for a tree whose prompt the update splits over ranks
    (replay.context_parallel: its ranks compute what they read, attending to the split prompt)."""
    r = run.cfg.replay
    if r.mode != "replay" or splits(model, tree, ContextParallel(list(range(r.context_parallel)), 0,
                                                                 r.context_parallel_tokens),
                                    r.join_below, r.budget_mb * 2**20 or None, r.offload_prefix):
        return set()
    spans, kept, _ = replay_plan(model, tree, run.cfg.replay.join_below, run.cfg.replay.budget_mb * 2**20 or None,
                                 run.cfg.replay.offload_prefix)
    return read_kv_nodes(spans, kept)


def cache_prefixes(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool slot held (the caching pass computes on its device). A tree gets
    only what a later stage reads of it, and nothing when nothing does."""
    if done := run.done(step, "prefixes"):
        return done
    run.begin(step, "prefixes")
    HOST_KV.clear()  # an earlier step's K/V are stale
    records, trees = load_trees(run, step)
    device, clock = run.device(devices), StateClock()
    model = clock(policy_before, run, step, device)
    # The reference (KL penalty, DPO) is the frozen base model: one more no-grad pass, logprobs
    # only; with LoRA the policy with its adapters off.
    reference = clock(RESIDENT.reference, run, device, model) if scores_reference(run.cfg) else None
    files, kv_entries, act_entries, gaps, cached, start = [], [], [], [], 0, time.perf_counter()
    for i, (record, tree) in enumerate(zip(tqdm(records, desc=f"step {step} prefix cache", leave=False), trees)):
        need = TreeNeeds.of(run, step, record, model, tree)
        nodes, entry, acts = _cache_tree(run, step, i, tree, model, reference if need.reference else None, need)
        kv_entries.append(nodes)
        act_entries.append(entry)
        files += [*nodes.values(), *([entry] if entry else [])]
        cached += need.anything
        if need.gap:
            gaps += logprob_gaps(tree, acts.entry_logprobs, record["logprobs"], sampled_flags(record))
        if i == 0:
            faults.hook("prefixes", step, "mid")  # some of the step's K/V written, no done marker
    return run.finish(step, "prefixes", {
        "files": files, "prefix_kv": kv_entries, "activations": act_entries, "trees_cached": cached,
        "unique_positions": sum(t.unique_positions for t in trees),
        "kv_bytes": sum(e["bytes"] for nodes in kv_entries for e in nodes.values()), "device": str(device),
        "seconds": time.perf_counter() - start, "state_seconds": clock.seconds, **gap_stats(gaps)})


@dataclass(frozen=True)
class TreeNeeds:
    """What later stages read of one tree's caching pass: the K/V of the branching nodes
    replay does not keep the graph of, the heads' scores (the policy's logprobs where a loss
    or the engine's mismatch reads them, a critic's old values), the reference's logprobs,
    and the drafter's hidden states. A tree that trains nothing (common.trains_nothing)
    needs no K/V or scores."""

    kv: frozenset[int]
    heads: Heads
    reference: bool
    hidden: bool
    gap: bool  # its logprobs measure the rollout engine's

    @classmethod
    def of(cls, run: Run, step: int, record: dict, model, tree) -> TreeNeeds:
        cfg = run.cfg
        trains = not trains_nothing(cfg, record)
        # A preference pair was not sampled; a stale tree's logprobs differ by the updates since too.
        gap = measures_gap(cfg, step) and record.get("logprobs") is not None and not record.get("staleness", 0)
        score = (trains and scores_logprobs(cfg)) or gap
        heads = {name: head for name, head in policy_heads(cfg).items()
                 if (name == LOGPROB and score) or (name != LOGPROB and trains)}
        return cls(frozenset(kv_read(run, model, tree)) if trains else frozenset(), heads,
                   trains and scores_reference(cfg), cfg.drafter.enabled, gap)

    @property
    def anything(self) -> bool:
        return bool(self.kv or self.heads or self.reference or self.hidden)


def _cache_tree(run: Run, step: int, index: int, tree, model, reference,
                need: TreeNeeds) -> tuple[dict, dict | None, TreeActivations | None]:
    """One tree's caching pass, as much as `need` asks: the K/V entries it wrote (by node),
    its activations file's entry (None when it scores and keeps nothing) and the activations."""
    if not need.anything:
        return {}, None, None
    acts = _capture(run, model, tree, need.heads, need.hidden, set(need.kv))
    if reference is not None:
        with adapters_off(reference):
            acts.ref_entry_logprobs = _capture(run, reference, tree, logprob_heads(sampled_as(run.cfg)),
                                               keep_hidden=False, kv_nodes=set()).entry_logprobs
    nodes = {}
    for node_id in sorted(need.kv):
        kv = acts.prefix_kv[node_id]
        if run.cfg.replay.kv_offload == "host":  # one copy off the device, both written and kept
            kv = tuple([_host_copy(t) for t in half] for half in kv)
        nodes[str(node_id)] = run.store.write_tensors(kv_key(run, step, index, node_id), kv_tensors(kv))
        if run.cfg.replay.kv_offload == "host":
            HOST_KV[nodes[str(node_id)]["sha256"]] = kv
    if not (need.heads or need.reference or need.hidden):
        return nodes, None, acts
    return nodes, run.store.write_tensors(activations_key(run, step, index), activation_tensors(acts)), acts


def scores_logprobs(cfg) -> bool:
    """Whether the caching pass scores the policy's logprobs for the loss: for the KL term,
    truncated importance sampling, PPO's old logprobs, DPO's margins, and the off-policy
    correction of stale trees (the ratio to the behaviour policy is no longer 1 at the start)."""
    a = cfg.algo
    return a.kl_coef > 0 or a.tis_cap > 0 or a.name in ("ppo", "dpo") or a.decoupled or cfg.rollout.max_staleness > 0


def measures_gap(cfg, step: int) -> bool:
    """Whether the caching pass of `step` measures the vLLM engine's logprobs against the
    trainer's (engine_logprob_gap_*): every rollout.vllm.logprob_gap_every steps, from step 0."""
    every = cfg.rollout.vllm.logprob_gap_every
    return cfg.rollout.engine == "vllm" and every > 0 and step % every == 0


def scores_reference(cfg) -> bool:
    """Whether the caching pass scores the frozen reference: for the KL term and for DPO."""
    return cfg.algo.kl_coef > 0 or cfg.algo.name == "dpo"


def logprob_gaps(tree, entry_logprobs: torch.Tensor, behaviour: list[list[float]],
                 sampled: list[list[bool]]) -> list[torch.Tensor]:
    """Per completion, |the rollout engine's logprob - the trainer's| of each token the model
    sampled (`sampled`: the record's flags; an episode's environment tokens have no behaviour
    logprob, stored as 0, and are left out)."""
    return [(trainer - torch.tensor(engine, dtype=torch.float64)).abs()[torch.tensor(flags, dtype=torch.bool)]
            for trainer, engine, flags in zip(tree.completion_values(entry_logprobs), behaviour, sampled)]


def gap_stats(gaps: list[torch.Tensor]) -> dict:
    """The training-inference mismatch over the step's tokens: mean and max |engine - trainer| logprob."""
    tokens = torch.cat(gaps) if gaps else torch.zeros(0)
    if not tokens.numel():
        return {}
    return {"engine_logprob_gap_mean": float(tokens.mean()), "engine_logprob_gap_max": float(tokens.max())}


def release_read(run: Run, step: int, stage: str) -> None:
    """Delete the step's outputs of the caching pass that nothing reads once `stage`
    ("policy" or "drafter") of `step` is done: the K/V after the update, the hidden states
    after the drafter (after the update, without one). Unless checkpoint.keep_step_data
    (Run.release: a recomputed update that needs them recomputes the caching pass)."""
    if run.cfg.checkpoint.keep_step_data:
        return
    if stage == "policy":
        run.release(step, "prefixes", run.key(step, "prefix_kv"), "prefix_kv")
    if stage == "drafter" or not run.cfg.drafter.enabled:
        run.release(step, "prefixes", run.key(step, "activations"), "activations")
