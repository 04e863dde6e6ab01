"""Stage 3: the caching pass. One no-grad forward per tree records the K/V of every
branching node (for replay), every entry's logprob (old logprobs) and every position's
last hidden state (drafter data), each tensor file with its sha256 in the manifest. The
per-rollout baseline instead runs every rollout's full sequence for the logprobs."""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from lsreplay import faults
from lsreplay.replay.capture import TreeActivations, capture_rollouts, capture_tree
from lsreplay.replay.segments import PrefixKV
from lsreplay.replay.view import read_kv_nodes, replay_view
from lsreplay.resident import RESIDENT
from lsreplay.run import Run
from lsreplay.stages.common import StateClock, load_trees, policy_before
from lsreplay.storage import StorageError

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
    out = {"entry_logprobs": acts.entry_logprobs, **{f"hidden.{n}": h for n, h in acts.hidden.items()}}
    if acts.ref_entry_logprobs is not None:
        out["ref_entry_logprobs"] = acts.ref_entry_logprobs
    return out


def load_activations(run: Run, step: int, tree: int, manifest: dict) -> TreeActivations:
    entry = manifest["activations"][tree]
    with run.reading(step, "prefixes"):
        tensors = run.store.read_tensors(entry["key"], sha256=entry["sha256"])
    hidden = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("hidden.")}
    return TreeActivations(entry_logprobs=tensors["entry_logprobs"], hidden=hidden,
                           ref_entry_logprobs=tensors.get("ref_entry_logprobs"))


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
        return [k.to(self.device) for k in keys], [v.to(self.device) for v in values]


def _capture(run: Run, model, tree, keep_hidden: bool) -> TreeActivations:
    """Branch replay's pass over the tree; the per-rollout baseline (replay.mode=naive), as a
    per-rollout trainer does, scores every rollout's full sequence (the drafter's hidden
    states, if it is on, still come from a tree pass)."""
    if run.cfg.replay.mode == "replay":
        return capture_tree(model, tree, keep_hidden=keep_hidden)
    acts = capture_rollouts(model, tree)
    if keep_hidden:
        acts.hidden = capture_tree(model, tree).hidden
    return acts


def cache_prefixes(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool slot held (the caching pass computes on its device)."""
    if done := run.done(step, "prefixes"):
        return done
    run.begin(step, "prefixes")
    HOST_KV.clear()  # an earlier step's K/V are stale
    _, trees = load_trees(run, step)
    device, clock = run.device(devices), StateClock()
    model = clock(policy_before, run, step, device)
    # The KL penalty's reference is the frozen base model: one more no-grad pass, logprobs only.
    reference = clock(RESIDENT.reference, run, device) if run.cfg.algo.kl_coef > 0 else None
    # Only replay reads the K/V back (those of the branching spans of its view), only the
    # drafter the hidden states.
    store_kv, keep_hidden = run.cfg.replay.mode == "replay", run.cfg.drafter.enabled
    files, kv_entries, act_entries, start = [], [], [], time.perf_counter()
    for i, tree in enumerate(tqdm(trees, desc=f"step {step} prefix cache", leave=False)):
        acts = _capture(run, model, tree, keep_hidden)
        if reference is not None:
            acts.ref_entry_logprobs = _capture(run, reference, tree, keep_hidden=False).entry_logprobs
        nodes = {}
        read = read_kv_nodes(replay_view(tree, run.cfg.replay.join_below)) if store_kv else set()
        for node_id in sorted(read):
            kv = acts.prefix_kv[node_id]
            nodes[str(node_id)] = run.store.write_tensors(kv_key(run, step, i, node_id), kv_tensors(kv))
            if run.cfg.replay.kv_offload == "host":
                HOST_KV[nodes[str(node_id)]["sha256"]] = kv
        act_entry = run.store.write_tensors(activations_key(run, step, i), activation_tensors(acts))
        kv_entries.append(nodes)
        act_entries.append(act_entry)
        files += [*nodes.values(), act_entry]
        if i == 0:
            faults.hook("prefixes", step, "mid")  # some of the step's K/V written, no done marker
    return run.finish(step, "prefixes", {
        "files": files, "prefix_kv": kv_entries, "activations": act_entries,
        "unique_positions": sum(t.unique_positions for t in trees),
        "kv_bytes": sum(e["bytes"] for nodes in kv_entries for e in nodes.values()), "device": str(device),
        "seconds": time.perf_counter() - start, "state_seconds": clock.seconds})


def release_prefixes(run: Run, step: int, part: str) -> None:
    """Delete the step's `part` ("prefix_kv" or "activations") once nothing of the run reads
    it again, unless checkpoint.keep_step_data. The done marker is rewritten first, without
    those files and naming them `released`, so the stage still counts as finished; a later
    read of them (a recomputed update) finds them missing and recomputes the stage."""
    if run.cfg.checkpoint.keep_step_data or (manifest := run.done(step, "prefixes")) is None:
        return
    folder = run.key(step, part)
    if part not in manifest.get("released", []):
        kept = [e for e in manifest["files"] if not e["key"].startswith(folder + "/")]
        run.store.write_json(run.key(step, "prefixes.done.json"),
                             {**manifest, "files": kept, "released": [*manifest.get("released", []), part]})
    run.store.delete_prefix(folder)
