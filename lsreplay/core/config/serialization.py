"""A config written out and compared: to_dict and to_yaml (secrets redacted), the result hash
a run's cache keys and resume checks use, and each key's trust classification (what a
resume takes from its own command rather than from a stored config)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import urllib.parse

from omegaconf import OmegaConf

from lsreplay.core.config.schema import Config

SECRET_KEYS = ("storage.key", "storage.secret")
# URLs that may carry credentials (https://user:token@host/..., ?token=...): written and sent
# with those parts as REDACTED (redact_url).
CREDENTIAL_URL_KEYS = ("storage.endpoint_url", "tracking.mlflow_uri")
REDACTED = "***"
# What each key that holds text names, for a resume (lsreplay.core.run.open_run_config): a
# stored config.json is what whoever can write the store wrote (the result_hash beside it
# they can recompute), so a key that names code, an interpreter, a cluster, a model, its
# weights, data or where the run writes and sends comes from the resume's own command where
# the store is not this user's alone. Numbers and booleans name nothing; every key holding
# text (or a list or dict of it) is classified here or in PLAIN_TEXT_KEYS, and
# tests/test_trust.py fails on one that is not.
COMMAND_KEYS = {
    "code": ("reward.functions", "reward.function", "rollout.tools", "rollout.environment",
             # transformers loads an attention kernel a name like kernels-community/... names
             "model.attn_implementation"),
    "interpreter": ("rollout.vllm.python",),
    "cluster": ("pool.ray_address",),  # the driver unpickles what that cluster's actors return
    "model": ("model.path", "model.arch"),
    "weights": ("model.cache_dir",),  # where the default model's converted weights and tokenizer lie
    "data": ("data.path", "eval.path", "data.tasks", "data.task_args"),
    # Where the run writes, and where it sends its credentials and metrics.
    "destination": ("run_dir", "storage.uri", "storage.endpoint_url", "tracking.dir", "tracking.mlflow_uri"),
}
# Keys holding text that names none of those: a choice among fixed values (validated), a
# column's or split's name, text the model reads, a name for the trackers, keywords.
PLAIN_TEXT_KEYS = (
    "model.dtype", "model.lora.target_modules", "model.rope_scaling", "data.prompt_truncation", "data.columns.prompt",
    "data.columns.question", "data.columns.answer", "data.columns.task", "data.split", "data.system_prompt",
    "data.answer_instruction", "data.example_messages", "data.chat_template_kwargs", "data.reward_fn_key",
    "rollout.engine", "rollout.branch_at", "rollout.tool_call_format", "algo.name", "algo.loss_agg",
    "algo.scale_rewards", "algo.tree_baseline", "algo.kl_estimator", "algo.advantage", "algo.dpo_source",
    "algo.dynamic_sampling_metric", "algo.overlong", "optim.schedule", "reward.styles", "reward.kwargs", "eval.split",
    "replay.mode", "replay.kv_offload", "pool.name", "pool.accelerator", "pool.task_runner", "report_to",
    "tracking.project", "tracking.run_name")
# Keys that do not change what a run computes: allowed to differ on resume.
NON_RESULT_KEYS = ("run_dir", "steps", "threads", "checkpoint", "storage", "pool", "report_to", "tracking",
                   "reward.timeout_seconds", "reward.untrusted", "rollout.untrusted_tools", "limits", "sandbox")


def command_keys() -> tuple[str, ...]:
    """Every key a resume takes from its own command where the store is not this user's alone."""
    return tuple(key for keys in COMMAND_KEYS.values() for key in keys)


def to_dict(cfg: Config, redact: bool = True) -> dict:
    """Plain dict of the config; secrets replaced by REDACTED unless `redact` is False: the
    credential keys, and the credentials in URLs (redact_url)."""
    d = _plain(cfg)
    if redact:
        for key in SECRET_KEYS:
            section, name = key.split(".")
            if d[section][name]:
                d[section][name] = REDACTED
        for key in CREDENTIAL_URL_KEYS:
            section, name = key.split(".")
            d[section][name] = redact_url(d[section][name])
    return d


def _plain(value, annotation: str = ""):
    """`value` as plain dicts, lists and scalars, a dataclass as the dict of its fields: what
    OmegaConf.to_container(OmegaConf.structured(...)) gives (a float key's int as a float,
    tuples as lists) in a hundredth of its time (0.34 ms against 61 ms for configs/default.yaml;
    every Run computes its result hash from it)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name), f.type) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(item, annotation.removeprefix("list[").removesuffix("]")) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if annotation.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# Names of what holds a credential: a URL's query parameters, environment variables.
SECRET_NAME = re.compile(r"token|secret|password|passwd|key|signature|credential|auth", re.IGNORECASE)


def has_credentials(url: str) -> bool:
    """Whether `url` carries a user name, a password or a credential query parameter."""
    return redact_url(url) != url


def redact_url(url: str) -> str:
    """`url` with its user:password part and its credential query values REDACTED."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{name}={REDACTED}" if SECRET_NAME.search(name) else f"{name}={value}" if sep else name
                     for name, sep, value in (p.partition("=") for p in parts.query.split("&") if p))
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def non_result_keys(cfg: Config) -> tuple[str, ...]:
    """NON_RESULT_KEYS, less `steps` where a decaying learning rate ends at the last step."""
    return tuple(k for k in NON_RESULT_KEYS if k != "steps" or cfg.optim.schedule == "constant")


def result_hash(cfg: Config) -> str:
    """Hash of everything that changes what a run computes (cache keys, resume checks)."""
    d = to_dict(cfg, redact=True)
    for key in non_result_keys(cfg):  # a section, or one key in it
        *sections, name = key.split(".")
        folder = d
        for section in sections:
            folder = folder[section]
        folder.pop(name)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
