"""A run: its config, its store, where each stage's outputs live, and what is finished.

Layout of a run's store (the run directory by default):

    config.yaml                     resolved config, secrets redacted
    metrics.jsonl                   one JSON line per finished step
    step_0000/prompts.json          the sampled prompt batch
    step_0000/trees.json            rollout trees: tokens, behaviour logprobs, rewards, texts
    step_0000/prefix_kv/...         cached K/V of every branching node (safetensors)
    step_0000/activations/...       entry logprobs and last hidden states per tree
    step_0000/<stage>.done.json     a stage's manifest, written last: the stage is finished
    checkpoints/policy/step_0000/   weights, optimizer state, RNG state after the step
    checkpoints/drafter/step_0000/  drafter weights after the step
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch

from lsreplay import config as config_mod
from lsreplay.config import Config, ConfigError
from lsreplay.storage import MissingEntry, Store

log = logging.getLogger(__name__)

STAGES = ("prompts", "trees", "prefixes", "policy", "drafter")


def open_store(cfg: Config) -> Store:
    s = cfg.storage
    uri = s.uri or cfg.run_dir
    options: dict = {}
    if uri.startswith("s3://"):
        if s.endpoint_url:
            options["client_kwargs"] = {"endpoint_url": s.endpoint_url}
        if s.key:
            options.update(key=s.key, secret=s.secret)
    return Store(uri, options)


class Run:
    def __init__(self, cfg: Config, store: Store | None = None):
        self.cfg = cfg
        self.store = store or open_store(cfg)
        self.config_hash = config_mod.result_hash(cfg)

    # -- keys -------------------------------------------------------------------------------
    @staticmethod
    def key(step: int, *parts: str) -> str:
        return "/".join([f"step_{step:04d}", *parts])

    @staticmethod
    def checkpoint(kind: str, step: int) -> str:
        return f"checkpoints/{kind}/step_{step:04d}"

    def seed(self, step: int, stage: str, *more: int) -> int:
        """A seed per (run seed, step, stage, ...): a resumed stage draws what it drew before."""
        text = json.dumps([self.cfg.seed, step, stage, *more])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)

    def generator(self, step: int, stage: str, *more: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed(step, stage, *more))

    # -- config on disk ---------------------------------------------------------------------
    def save_or_check_config(self, force: bool = False) -> None:
        """First run: write config.yaml. Resume: refuse a config that changes results."""
        if self.store.exists("config.json"):
            saved = self.store.read_json("config.json")
            if saved["result_hash"] != self.config_hash and not force:
                raise ConfigError(
                    f"the run at {self.store.uri} was started with a different config "
                    f"({_diff(saved['config'], config_mod.to_dict(self.cfg))}); use a new run_dir, "
                    "or pass --force to continue with the new values")
        self.store.write_bytes("config.yaml", config_mod.to_yaml(self.cfg).encode())
        self.store.write_json("config.json", {"result_hash": self.config_hash,
                                              "config": config_mod.to_dict(self.cfg)})

    # -- stage completion -------------------------------------------------------------------
    def done(self, step: int, stage: str) -> dict | None:
        """The stage's manifest if it finished and its files are all there, else None."""
        marker = self.key(step, f"{stage}.done.json")
        if not self.store.exists(marker):
            return None
        manifest = self.store.read_json(marker)
        missing = [e["key"] for e in manifest.get("files", []) if not self.store.exists(e["key"])]
        if missing:
            log.warning("step %d %s: %d output files missing (%s...); recomputing the stage",
                        step, stage, len(missing), missing[0])
            return None
        return manifest

    def finish(self, step: int, stage: str, manifest: dict) -> dict:
        manifest = {"step": step, "stage": stage, "config_hash": self.config_hash, **manifest}
        self.store.write_json(self.key(step, f"{stage}.done.json"), manifest)
        return manifest

    def append_metrics(self, record: dict) -> None:
        """Rewrite metrics.jsonl with `record` replacing any earlier line of its step."""
        try:
            lines = self.store.read_bytes("metrics.jsonl").decode().splitlines()
        except MissingEntry:
            lines = []
        rows = [json.loads(x) for x in lines if x.strip()]
        rows = [r for r in rows if r.get("step") != record["step"]] + [record]
        rows.sort(key=lambda r: r["step"])
        self.store.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())

    def metrics(self) -> list[dict]:
        try:
            return [json.loads(x) for x in self.store.read_bytes("metrics.jsonl").decode().splitlines() if x]
        except MissingEntry:
            return []


def _diff(old: dict, new: dict, prefix: str = "") -> str:
    changed = []
    for k in sorted(set(old) | set(new)):
        if prefix == "" and k in config_mod.NON_RESULT_KEYS:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _diff(a, b, f"{prefix}{k}.")
            if inner:
                changed.append(inner)
        elif a != b:
            changed.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return "; ".join(changed)
