"""A run: its config, its store, where each stage's outputs live, and what is finished.

Layout of a run's store (the run directory by default):

    config.yaml                     resolved config, secrets redacted
    run.lock                        held by the process that runs the run (lsreplay.core.run_lock)
    metrics.jsonl                   one JSON line per finished step
    step_0000/prompts.json          the sampled prompt batch
    step_0000/trees/shard_00.json   one rollout shard's trees (rollout.shards of them): tokens,
                                    behaviour logprobs, rewards, texts; the step's trees are its shards'
    step_0000/prefix_kv/...         cached K/V of every branching node (safetensors); deleted
                                    once the step's update is done (checkpoint.keep_step_data)
    step_0000/activations/...       entry logprobs and last hidden states per tree; deleted
                                    once the step's update and drafter are done
    step_0000/<stage>.done.json     a stage's manifest, written last: the stage is finished
    executions/step_0000/<stage>/   one small JSON per time a stage actually started work
    checkpoints/policy/step_0000/   float32 master weights, AdamW, RNG state after the step, every
                                    checkpoint.every steps; checkpoint.json (written last) = complete
    checkpoints/drafter/step_0000/  drafter (float32 master) weights, optimizer, sampler state (spot.json:
                                    resumable), hf/ export (compute dtype)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import posixpath
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from lsreplay.core import config as config_mod
from lsreplay.core import faults
from lsreplay.core.config import Config, ConfigError
from lsreplay.core.devices import cuda_determinism, torch_device
from lsreplay.core.layout import CheckpointError, checkpoint_folder
from lsreplay.core.storage import CorruptEntry, MalformedEntry, MissingEntry, Store, is_file_record

log = logging.getLogger(__name__)


class InputCorrupt(RuntimeError):
    """A finished stage's output turned out missing or damaged when a later stage read it.
    The flow deletes that stage's done marker and computes it again (deterministically)."""

    def __init__(self, step: int, stage: str, cause: BaseException | str):
        self.step, self.stage = step, stage
        super().__init__(f"output of stage {stage} of step {step} is unusable ({cause}); it will be recomputed")

    def __reduce__(self):  # keep the fields when the exception crosses a process or a pickle
        return (type(self), (self.step, self.stage, str(self)))


class StageFailed(RuntimeError):
    """A stage failed for good; the message names the stage, the step and the cause.
    `bad_input`: the cause is an entry of the store that is not of the structure lsreplay
    writes (MalformedEntry), which the command reports as bad input (exit status 2)."""

    def __init__(self, stage: str, step: int, cause: BaseException | str, bad_input: bool | None = None):
        self.stage, self.step = stage, step
        self.bad_input = isinstance(cause, MalformedEntry) if bad_input is None else bad_input
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"stage {stage} of step {step} failed: {text}")

    def __reduce__(self):
        return (type(self), (self.stage, self.step, str(self).split(" failed: ", 1)[-1], self.bad_input))


def open_store(cfg: Config) -> Store:
    s = cfg.storage
    uri = s.uri or cfg.run_dir
    options: dict = {}
    if uri.startswith("s3://"):
        # Credentials and endpoint from the config, else from the usual AWS variables.
        endpoint = s.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        if s.key:
            options.update(key=s.key, secret=s.secret or os.environ.get("AWS_SECRET_ACCESS_KEY", ""))
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
        return checkpoint_folder(kind, step)

    def seed(self, step: int, stage: str, *more: int) -> int:
        """A seed per (run seed, step, stage, ...): a resumed stage draws what it drew before."""
        text = json.dumps([self.cfg.seed, step, stage, *more])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)

    def generator(self, step: int, stage: str, *more: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on `device` seeded per (step, stage, ...): draws on that device use it."""
        return torch.Generator(device=device).manual_seed(self.seed(step, stage, *more))

    def device(self, devices: list[int] | None) -> torch.device:
        """The device a stage holding pool slots `devices` computes on (its first)."""
        return torch_device(self.cfg.pool, devices[0] if devices else None)

    # -- config on disk ---------------------------------------------------------------------
    def saved_config(self) -> dict | None:
        """The run's config.json ({"result_hash", "config"}), None if the run has none yet;
        MalformedEntry if it is JSON of another structure."""
        try:
            saved = self.store.read_json("config.json")
        except MissingEntry:
            return None
        if not (isinstance(saved, dict) and isinstance(saved.get("result_hash"), str)
                and isinstance(saved.get("config"), dict)):
            raise MalformedEntry(f"{self.store.url('config.json')} is valid JSON but not a run's config.json (a "
                                 "'result_hash' and a 'config' mapping): another program wrote it or it was edited; "
                                 "restore it (config.yaml beside it holds the run's keys), or start a new run_dir")
        return saved

    def check_config(self, force: bool = False) -> bool:
        """Refuse a config that changes the results of an existing run (unless `force`).
        True if the run already exists."""
        if (saved := self.saved_config()) is None:
            return False
        if saved["result_hash"] != self.config_hash and not force:
            raise ConfigError(
                f"the run at {self.store.uri} was started with a different config "
                f"({_diff(saved['config'], config_mod.to_dict(self.cfg), config_mod.non_result_keys(self.cfg))}); "
                "use a new run_dir, "
                "or pass --force to continue with the new values")
        return True

    def with_pinned_threads(self) -> Run:
        """This run with `threads` fixed: as configured, else as recorded when the run
        started, else this process's torch thread count now (recorded by
        save_or_check_config). Every stage then computes with that count (`begin`)."""
        threads = self.cfg.threads
        if threads == 0 and (saved := self.saved_config()) is not None:
            threads = saved["config"].get("threads", 0)
        if threads == 0:
            threads = torch.get_num_threads()
        return Run(dataclasses.replace(self.cfg, threads=threads), self.store)

    def save_or_check_config(self, force: bool = False) -> None:
        """First run: write config.yaml. Resume: refuse a config that changes results."""
        self.check_config(force)
        self.store.write_bytes("config.yaml", config_mod.to_yaml(self.cfg).encode())
        self.store.write_json("config.json", {"result_hash": self.config_hash,
                                              "config": config_mod.to_dict(self.cfg)}, commit=True)

    # -- stage completion -------------------------------------------------------------------
    def done(self, step: int, stage: str) -> dict | None:
        """The stage's manifest if it finished and its files are all there with the sizes
        written, else None. (The sha256 of each file is checked where it is read.)"""
        marker = self.key(step, f"{stage}.done.json")
        try:
            manifest = self.store.read_json(marker)
        except MissingEntry:
            return None
        except CorruptEntry as e:
            log.warning("step %d %s: unreadable done marker (%s); recomputing the stage", step, stage, e)
            return None
        if not (isinstance(manifest, dict) and isinstance(manifest.get("files", []), list)
                and all(map(is_file_record, manifest.get("files", [])))):
            raise MalformedEntry(f"{self.store.url(marker)} is valid JSON but not a done marker (a mapping whose "
                                 "'files' list each written file's key, bytes and sha256): another program wrote it or "
                                 "it was edited; delete it, and the stage runs again")
        files = manifest.get("files", [])
        sizes = self.store.sizes(_common_dir([e["key"] for e in files])) if files else {}
        bad = [e["key"] for e in files if sizes.get(e["key"]) != e["bytes"]]
        if bad:
            log.warning("step %d %s: %d output files missing or of the wrong size (%s...); recomputing the stage",
                        step, stage, len(bad), bad[0])
            return None
        return manifest

    def release(self, step: int, stage: str, folder: str, name: str) -> None:
        """Delete the stage's outputs under `folder` that nothing of the run reads again. Its
        done marker is rewritten first, without those files and naming them (`name`) as
        released, so the stage still counts as finished; a later read of them finds them
        missing (InputCorrupt), and the stage is recomputed."""
        manifest = self.done(step, stage)
        if manifest is not None and name not in manifest.get("released", []):
            kept = [e for e in manifest["files"] if not e["key"].startswith(folder + "/")]
            self.store.write_json(self.key(step, f"{stage}.done.json"),
                                  {**manifest, "files": kept, "released": [*manifest.get("released", []), name]},
                                  commit=True)
        self.store.delete_prefix(folder)

    def manifest(self, step: int, stage: str) -> dict:
        """The manifest of a stage whose outputs this stage needs; InputCorrupt if unusable."""
        if done := self.done(step, stage):
            return done
        raise InputCorrupt(step, stage, "it is not finished, or its files are missing")

    @contextlib.contextmanager
    def reading(self, step: int, stage: str) -> Iterator[None]:
        """Reads of stage `stage`'s outputs of `step`: a missing or damaged file -> InputCorrupt."""
        try:
            yield
        except (MissingEntry, CorruptEntry) as e:
            raise InputCorrupt(step, stage, e) from e
        except CheckpointError as e:
            if isinstance(e.__cause__, (MissingEntry, CorruptEntry)):
                raise InputCorrupt(step, stage, e) from e
            raise

    def checkpoint_manifest(self, kind: str, step: int) -> dict:
        """The checkpoint manifest ({"prefix", "files": {name: entry}}) that the stage which
        wrote checkpoint `kind` of `step` recorded, for verified loading."""
        done = self.manifest(step, kind)
        prefix = self.checkpoint(kind, step)
        return {"prefix": prefix, "files": {posixpath.basename(e["key"]): e for e in done["files"]
                                            if posixpath.dirname(e["key"]) == prefix}}

    @staticmethod
    def sha256(manifest: dict, key: str) -> str | None:
        """The sha256 a manifest recorded for `key` (None if it lists no such file)."""
        return next((e["sha256"] for e in manifest.get("files", []) if e["key"] == key), None)

    def invalidate(self, step: int, stage: str) -> None:
        """Forget that a stage finished, and its parts (trees: its shards): it runs again
        (its outputs are overwritten)."""
        for key in self.store.list(self.key(step)):
            name = posixpath.basename(key)
            if name == f"{stage}.done.json" or (name.startswith(f"{stage}-") and name.endswith(".done.json")):
                self.store.delete(key)

    def begin(self, step: int, stage: str) -> None:
        """A stage starts real work: record it (executions/), compute with the run's thread count and, on a
        GPU pool, deterministically (devices.cuda_determinism), and give injected faults their chance."""
        now = datetime.datetime.now(datetime.UTC)
        name = f"{now:%Y%m%dT%H%M%S%f}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self.store.write_json(f"executions/step_{step:04d}/{stage}/{name}", {
            "step": step, "stage": stage, "started": now.isoformat(), "pid": os.getpid(),
            "host": socket.gethostname()})
        self._started = now.timestamp()
        if self.cfg.threads:  # per thread: torch keeps each thread's OpenMP count
            torch.set_num_threads(self.cfg.threads)
        cuda_determinism(self.cfg.pool)
        faults.hook(stage, step, "start")

    def executions(self) -> dict[tuple[int, str], int]:
        """How many times each (step, stage) actually started work."""
        counts: dict[tuple[int, str], int] = {}
        for key in self.store.list("executions"):
            _, step, stage, _ = key.split("/")
            where = (int(step.removeprefix("step_")), stage)
            counts[where] = counts.get(where, 0) + 1
        return counts

    def finish(self, step: int, stage: str, manifest: dict) -> dict:
        """Write the stage's done marker; the manifest gains wall-clock `started` (from
        `begin`, unless given) and `ended` times, so overlapping stages can be told apart."""
        times = {"started": getattr(self, "_started", None), "ended": time.time()}
        manifest = {"step": step, "stage": stage, "config_hash": self.config_hash, **times, **manifest}
        self.store.write_json(self.key(step, f"{stage}.done.json"), manifest, commit=True)
        return manifest

    def append_metrics(self, record: dict) -> None:
        """Rewrite metrics.jsonl with `record` merged into the line of its step (a step's
        evaluation and its training figures are recorded apart)."""
        rows = self.metrics()
        earlier = next((r for r in rows if r.get("step") == record["step"]), {})
        rows = [r for r in rows if r.get("step") != record["step"]] + [{**earlier, **record}]
        rows.sort(key=lambda r: r["step"])
        self.store.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode(), commit=True)

    def keep_metrics_until(self, step: int) -> None:
        """Drop metrics.jsonl's lines after `step`, but the held-out figures of step + 1 (the
        evaluation of the policy after `step`'s update)."""
        rows = []
        for row in self.metrics():
            if row["step"] == step + 1:
                row = {k: v for k, v in row.items() if k == "step" or k.startswith("eval_")}
            if row["step"] <= step or len(row) > 1:
                rows.append(row)
        self.store.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode(), commit=True)

    def metrics(self) -> list[dict]:
        """metrics.jsonl's lines; MalformedEntry naming the line that is not a step's record."""
        try:
            lines = self.store.read_bytes("metrics.jsonl").decode(errors="replace").splitlines()
        except MissingEntry:
            return []
        return [self._metrics_row(line, number) for number, line in enumerate(lines, 1) if line.strip()]

    def _metrics_row(self, line: str, number: int) -> dict:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise MalformedEntry(f"line {number} of {self.store.url('metrics.jsonl')} is not a step's metrics (a JSON "
                                 f"object with its 'step'): {line[:80]!r}; fix or delete that line")
        return row


def open_run_config(uri: str, overrides: list[str] = (), runs_code: bool = True) -> Config:
    """The config an existing run was started with (its config.json), with `overrides` on top.

    `uri` is the run directory or the run's storage URI (s3://bucket/prefix; give the
    endpoint as the override storage.endpoint_url=... if it is not AWS's). Redacted secrets
    are dropped: credentials come from the environment or the overrides. `runs_code`: the
    config is for running the run (a resume), so the stored values of the keys that name
    code, models, data and destinations must be vouched for (`_check_command_keys`)."""
    local = "://" not in uri or uri.startswith("file://")
    where = [f"run_dir={uri}"] if local else [f"storage.uri={uri}"]
    probe = config_mod.load_config(None, where + [o for o in overrides if o.lstrip("+").startswith("storage")])
    store = open_store(probe)
    if (found := Run(probe, store).saved_config()) is None:
        raise ConfigError(f"{uri} holds no run (no config.json there); start one with `lsreplay train`")
    saved = found["config"]
    for key in (*config_mod.SECRET_KEYS, *config_mod.CREDENTIAL_URL_KEYS):
        section, name = key.split(".")
        if config_mod.REDACTED in str(saved.get(section, {}).get(name, "")):
            saved[section][name] = ""
    if runs_code:
        _check_command_keys(store, saved, [*overrides, *where], uri)
    if local:
        saved["run_dir"] = uri
    else:
        saved.setdefault("storage", {})["uri"] = uri
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(saved)))
    try:
        return config_mod.load_config(f.name, list(overrides))
    finally:
        os.unlink(f.name)


def _check_command_keys(store: Store, saved: dict, given: list[str], uri: str) -> None:
    """Refuse a stored config whose keys naming code, an interpreter, a cluster, a model, its
    weights, data or destinations (config.COMMAND_KEYS) hold what the resume's own command
    does not name: whoever can write the store can change config.json, and a resume would
    run, load, read or send to what it names. A key the command gives (among `given`, the
    overrides and where the command opened the run; or its section) takes the command's
    value; a stored value equal to the default needs none. A run folder on this machine that
    only this user can write is this user's own record, and trusted."""
    if store.local and _only_mine(Path(store.uri) / "config.json"):
        return
    named = _given_keys(given)
    defaults = config_mod.to_dict(Config())
    stored = {key: value for key in config_mod.command_keys()
              if (value := _select(saved, key)) != _select(defaults, key)
              and not any(key == g or key.startswith(g + ".")
                          or (key in config_mod.FREE_DICTS and g.startswith(key + ".")) for g in named)}
    if stored:
        repeat = " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in stored.items())
        raise ConfigError(f"{store.url('config.json')} names code, a model, data or destinations this resume would "
                          f"use: {repeat}; whoever can write the store can change that file, so a resume takes these "
                          f"from its own command: repeat them (lsreplay resume {uri} {repeat})")


def _given_keys(overrides: list[str]) -> list[str]:
    """The dotted keys `key=value` overrides set: a section given as a mapping sets the keys
    inside it only (the others keep their stored values), a free dict (model.arch) is one key."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip().lstrip("+")
        try:
            given = yaml.safe_load(value)
        except yaml.YAMLError:
            given = None
        whole = any(key == d or key.startswith(d + ".") for d in config_mod.FREE_DICTS)
        mapping = isinstance(given, dict) and given and not whole
        out += [f"{key}.{leaf}" for leaf in config_mod.dotted_leaves(given)] if mapping else [key]
    return out


def _only_mine(path: Path) -> bool:
    """Whether `path` and its folder belong to this user and no one else can write them."""
    try:
        return all(p.stat().st_uid == os.getuid() and not p.stat().st_mode & 0o022 for p in (path, path.parent))
    except OSError:
        return False


def _select(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _common_dir(keys: list[str]) -> str:
    """The deepest folder holding all of `keys`."""
    common = posixpath.commonpath([posixpath.dirname(k) or "." for k in keys]) if keys else ""
    return "" if common == "." else common


def _diff(old: dict, new: dict, skip: tuple[str, ...] = config_mod.NON_RESULT_KEYS, prefix: str = "") -> str:
    changed = []
    for k in sorted(set(old) | set(new)):
        if f"{prefix}{k}" in skip:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _diff(a, b, skip, f"{prefix}{k}.")
            if inner:
                changed.append(inner)
        elif a != b:
            changed.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return "; ".join(changed)
