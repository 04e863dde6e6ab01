"""A config loaded: schema defaults <- a YAML file <- `key=value` overrides, merged with
OmegaConf; TRL's spellings of report_to, lora targets and scale_rewards taken as TRL takes
them; every unknown key named at once with the keys allowed there, lsreplay's name for TRL's
or verl's (aliases.py) or the nearest keys; then settled and validated (validation.py)."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from difflib import get_close_matches
from importlib.util import find_spec
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lsreplay.core.config.aliases import alias_of
from lsreplay.core.config.data import ANSWER_INSTRUCTION, SYSTEM_PROMPT
from lsreplay.core.config.runtime import TRACKERS
from lsreplay.core.config.schema import Config, ConfigError
from lsreplay.core.config.training import SCALE_REWARDS_BOOLEANS
from lsreplay.core.config.validation import validate


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Schema defaults <- YAML file <- `key=value` overrides, then settled (`settle`) and
    validated. Every unknown key of the file and the overrides is reported at once."""
    try:
        layers = ([_file_layer(path)] if path is not None else []) + [_override_layer(item) for item in overrides]
        unknown = [key for layer, _ in layers for key in _unknown_keys(OmegaConf.to_container(layer))]
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown))
        merged = OmegaConf.structured(Config)
        for layer, replaced in layers:
            _merge_into(merged, layer, replaced)
        cfg = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        raise ConfigError(_unknown_keys_message([e.full_key or str(e.key)])) from None
    except ValidationError as e:
        raise ConfigError(f"config key {e.full_key!r}: {e.msg.splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    settle(cfg)
    validate(cfg)
    return cfg


def _load_yaml(path: str | Path) -> DictConfig:
    """A config file's keys; ConfigError naming the file, the place and the fix if it is no
    YAML mapping."""
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_problem(e)}); fix it there: one `key: value` "
                          "per line, nested keys indented under their section, lists as [a, b]") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} holds a {type(layer).__name__.removesuffix('Config').lower()}, not a "
                          "mapping of config keys; write it as `key: value` lines (e.g. steps: 3)")
    return layer


def _yaml_problem(error: yaml.YAMLError, line: bool = True) -> str:
    """What YAML's parser found wrong and where: line and column in a file, the character of
    a one-line value (`line` False; past its end: "at its end")."""
    problem, mark = getattr(error, "problem", None) or str(error), getattr(error, "problem_mark", None)
    if mark is None:
        return problem
    if line:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return f"{problem} at its end" if mark.line else f"{problem} at character {mark.column + 1}"


def _file_layer(path: str | Path) -> tuple[DictConfig, list[str]]:
    """A YAML file as a layer, and the free dicts it gives whole (they replace the defaults')."""
    layer = _lora_targets_as_peft(_report_to_as_trl(_load_yaml(path)))
    return layer, _given_whole(layer)


def _override_layer(item: str) -> tuple[DictConfig, list[str]]:
    """A `key=value` override as a layer (Hydra's +key and ++key too: the keys exist), and
    the free dict it gives whole, if it does."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. steps=2)")
    item = item.lstrip().removeprefix("++").removeprefix("+")
    key, _, value = (part.strip() for part in item.partition("="))
    if value == "":  # data.system_prompt= : the empty string (OmegaConf would read null)
        item = f"{key}=''"
    try:
        layer = _lora_targets_as_peft(_report_to_as_trl(OmegaConf.from_dotlist([item])))
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: its value is not valid YAML ({_yaml_problem(e, line=False)}); "
                          "close its brackets and braces (e.g. rollout.branching=[4,2]), or quote a value "
                          "meant as text") from None
    given_whole = any(key == k or key.startswith(k + ".") for k in FREE_DICTS) and \
        isinstance(OmegaConf.select(layer, key), DictConfig)
    return layer, [key] if given_whole else []


def _report_to_as_trl(layer: DictConfig) -> DictConfig:
    """report_to as TRL takes it: one name or a comma-separated string (YAML's `report_to:
    wandb` too), "all" (the trackers installed here) or "none"."""
    value = layer.get("report_to") if isinstance(layer, DictConfig) else None
    if value is None:
        return layer
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]
    chosen = []
    for name in names:
        chosen += [t for t in TRACKERS if find_spec(t) is not None] if name == "all" else \
            [] if name in ("none", "") else [name]
    layer["report_to"] = list(dict.fromkeys(chosen))
    return layer


def _lora_targets_as_peft(layer: DictConfig) -> DictConfig:
    """model.lora.target_modules as PEFT takes it: one string (all-linear, or one name) too."""
    value = OmegaConf.select(layer, "model.lora.target_modules") if isinstance(layer, DictConfig) else None
    if isinstance(value, str):
        OmegaConf.update(layer, "model.lora.target_modules", [value], merge=False)
    return layer


def settle(cfg: Config) -> None:
    """What a loaded config leaves to be decided: the prompt additions left unset (lsreplay's
    own for the prompts it generates, nothing for data.path) and TRL's booleans for
    algo.scale_rewards."""
    d, own = cfg.data, not cfg.data.path
    if d.system_prompt is None:
        d.system_prompt = SYSTEM_PROMPT if own else ""
    if d.answer_instruction is None:
        d.answer_instruction = ANSWER_INSTRUCTION if own else ""
    if d.chat_template is None:
        d.chat_template = own
    scale = str(cfg.algo.scale_rewards)
    cfg.algo.scale_rewards = SCALE_REWARDS_BOOLEANS.get(scale.lower(), scale)


def _default_of(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _unknown_keys(layer: dict, cls=Config, prefix: str = "") -> list[str]:
    """The dotted keys of a config layer (a plain dict) that the schema has no place for. A
    section unknown as a whole is named by every key under it (verl's nested keys)."""
    known = {f.name: f for f in fields(cls)}
    out = []
    for name, value in layer.items():
        key = f"{prefix}{name}"
        if name not in known:
            out += [f"{key}.{leaf}" for leaf in dotted_leaves(value)] if isinstance(value, dict) and value \
                else [key]
            continue
        default = _default_of(known[name])
        if is_dataclass(default) and isinstance(value, dict):
            out += _unknown_keys(value, type(default), key + ".")
    return out


def dotted_leaves(d: dict) -> list[str]:
    """The dotted keys of a nested dict's values."""
    out = []
    for k, v in d.items():
        out += [f"{k}.{leaf}" for leaf in dotted_leaves(v)] if isinstance(v, dict) and v else [str(k)]
    return out


def _free_dicts(cls=Config, prefix: str = "") -> list[str]:
    """Dotted keys of the schema's free-form dict fields (data.task_args, model.arch)."""
    out = []
    for f in fields(cls):
        default = _default_of(f)
        if is_dataclass(default):
            out += _free_dicts(type(default), f"{prefix}{f.name}.")
        elif isinstance(default, dict):
            out.append(prefix + f.name)
    return out


# A YAML file or an override that gives one of these (or an entry of one, `key={...}`) as a
# whole mapping replaces what was there: merging would keep the defaults' entries, and a
# config could never clear them. A dotted key (data.task_args.chain_sum.min_terms=3) edits.
FREE_DICTS = tuple(_free_dicts())


def _given_whole(layer) -> list[str]:
    return [k for k in FREE_DICTS if OmegaConf.select(layer, k) is not None]


def _merge_into(merged: DictConfig, layer: DictConfig, replaced: list[str]) -> None:
    """`layer` merged into `merged` in place, its free dicts given whole (`replaced`) first
    emptied there. In place: OmegaConf.merge copies the whole schema first, and a command's
    dozen overrides made a dozen copies (a third of a second a load)."""
    for key in replaced:
        OmegaConf.update(merged, key, {}, merge=False)
    merged.merge_with(layer)


def from_dict(d: dict) -> Config:
    """Rebuild a Config from `to_dict` output (e.g. passed through a Prefect flow)."""
    layer, merged = OmegaConf.create(d), OmegaConf.structured(Config)
    _merge_into(merged, layer, _given_whole(layer))
    cfg = OmegaConf.to_object(merged)
    settle(cfg)
    validate(cfg)
    return cfg


def schema_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema that holds a value (not a section)."""
    out = []
    for f in fields(cls):
        default = _default_of(f)
        out += schema_keys(type(default), f"{prefix}{f.name}.") if is_dataclass(default) else [prefix + f.name]
    return out


def _unknown_keys_message(keys: list[str]) -> str:
    """One message for every unknown key: each with the keys allowed where it is, and
    lsreplay's name for TRL's and verl's (aliases.py) or the nearest keys."""
    if len(keys) == 1:
        return _unknown_key_message(keys[0])
    return f"{len(keys)} unknown config keys:\n" + "\n".join(f"  {_unknown_key_message(k)}" for k in keys)


def _unknown_key_message(key: str) -> str:
    """The key, the keys allowed in the deepest section of it that exists, and lsreplay's
    name for TRL's and verl's key (or the nearest keys)."""
    section, known = Config(), []
    for part in key.split(".")[:-1]:
        inner = getattr(section, part, None)
        if not is_dataclass(inner):
            break
        section, known = inner, known + [part]
    found = alias_of(key)
    if found:
        return f"unknown config key {key!r}: {found[0]!r} is TRL's or verl's name: lsreplay's key is {found[1]}"
    where = f"under {'.'.join(known)!r}" if known else "at the top level"
    return (f"unknown config key {key!r}; allowed keys {where}: {', '.join(f.name for f in fields(section))}"
            f"{_did_you_mean(key, key.rpartition('.')[2], schema_keys())}")


def _did_you_mean(key: str, name: str, keys: list[str]) -> str:
    """The schema keys nearest `key`, by the whole dotted key or by its last part."""
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rpartition(".")[2], []).append(k)
    near = get_close_matches(key, keys, n=3, cutoff=0.6)
    near += [k for n in get_close_matches(name, by_name, n=3, cutoff=0.75) for k in by_name[n]]
    near = list(dict.fromkeys(near))[:3]
    return f"; did you mean {' or '.join(near)}?" if near else ""
