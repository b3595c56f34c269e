"""Plain nested dicts <-> the frozen configs of `gpurl.config`: reading a run's
config.yaml (older layouts upgraded), writing it, and the YAML spelling of field names."""

from __future__ import annotations

import dataclasses
import enum
import keyword
import typing
from typing import Any, Callable

from gpurl.config.run import Config, EvalConfig

# Keys that moved into a group: old top-level name -> new dotted name. The command line
# and run directories written before the move keep working (`upgrade`).
MOVED_KEYS = {"reward_weights": "rewards.weights", "rewards_on_error": "rewards.on_error",
              "reward_timeout_s": "rewards.timeout_s"}
# Keys replaced by a choice: old dotted name -> (the new key, its value for each old value).
# The command line refuses them with one sentence; older run directories are read as the
# choice they meant (`upgrade`).
REPLACED_KEYS = {"rollout.async": ("rollout.mode", {True: "one_ahead", False: "sync"}),
                 "rollout.continuous": ("rollout.mode", {True: "continuous", False: "sync"})}
# `rewards=[...]` (a list, the documented short form) sets `rewards.functions`.
REWARDS_SHORTHAND = ("rewards", "rewards.functions")
# List keys that also take one bare value on the command line: `suite=gsm8k` is
# `suite=[gsm8k]`, `train.suites=gsm8k` is `train.suites=[gsm8k]` (a bare value is no list
# to Hydra).
LIST_SHORTHAND = ("suite", "train.suites")


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A root config dict in today's layout: moved keys in their groups, `rewards` as a
    list read as `rewards.functions`."""
    out = dict(data)
    short, full = REWARDS_SHORTHAND
    if isinstance(out.get(short), (list, tuple)):
        out[short] = {full.partition(".")[2]: list(out[short])}
    for old, new in MOVED_KEYS.items():
        if old in out:
            group, _, key = new.partition(".")
            out[group] = {**(out.get(group) or {}), key: out.pop(old)}
    for old, (new, values) in REPLACED_KEYS.items():
        group, _, key = old.partition(".")
        section = out.get(group)
        if isinstance(section, dict) and key in section:
            section = dict(section)
            value = values[bool(section.pop(key))]
            # a `true` one wins over the other's `false`
            if value != "sync" or new.partition(".")[2] not in section:
                section[new.partition(".")[2]] = value
            out[group] = section
    return out


def replaced_key(key: str, value: str) -> str | None:
    """The sentence refusing an override of a replaced key (`REPLACED_KEYS`); None for
    every other key."""
    if key not in REPLACED_KEYS:
        return None
    new, values = REPLACED_KEYS[key]
    choice = values[value.strip().lower() in ("true", "1", "yes", "on")]
    return (f"{key} was replaced by {new}; set {new}={choice} "
            f"(one of sync, one_ahead, continuous) instead.")


def to_dict(cfg: Any) -> Any:
    """Plain nested dict of a config (for config.yaml, wandb, and resume checks)."""
    out = dataclasses.asdict(cfg)
    def fix(d: Any) -> Any:
        if isinstance(d, dict):
            return {("async" if k == "async_" else k): fix(v) for k, v in d.items()}
        if isinstance(d, tuple):
            return [fix(v) for v in d]
        if isinstance(d, enum.Enum):
            return d.value
        return d
    return fix(out)


def yaml_key(name: str) -> str:
    """`async_` (a Python keyword with a suffix) is `async` in YAML and on the command line."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


# Picks the class of a config node from its data (the algo node's schema from its name).
Chooser = Callable[[type, dict[str, Any]], type]


def from_dict(data: dict[str, Any], cls: type = Config, choose: Chooser | None = None) -> Any:
    """Builds (and so validates) a frozen config from nested plain dicts, e.g. a run's
    config.yaml; keys missing from `data` take their defaults, keys the schema lacks are
    ignored (Hydra has refused them on the command line). `choose(cls, data)` may replace
    a node's class by a subclass (`gpurl.algorithms.registry.parse` does, for `algo`)."""
    if cls in (Config, EvalConfig):
        data = upgrade(data)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = yaml_key(f.name)
        if key in data:
            sub = hints[f.name]
            if dataclasses.is_dataclass(sub):
                sub = choose(sub, data[key]) if choose is not None else sub
                kwargs[f.name] = from_dict(data[key], sub, choose)
            else:
                kwargs[f.name] = data[key]
    return cls(**kwargs)
