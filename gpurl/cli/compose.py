"""Hydra composition of configs/ over the schemas of `gpurl.config`, the one conversion to
frozen dataclasses, and composition errors as one sentence with the fix.

Every algorithm schema is stored group-less in the ConfigStore as `gpurl_<schema>` (e.g.
`gpurl_algo_grpo`); each option of configs/algo/ names its schema first in its defaults
list, so `algo.*` keys are typed and checked per algorithm. Keys that moved keep working
on the command line with a one-line notice (`gpurl.config.dicts.MOVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError
import yaml

import gpurl
from gpurl.algorithms import registry
from gpurl.config import Config, ConfigError, EvalConfig, GenerateConfig, ServeConfig
from gpurl.config.dicts import (LIST_SHORTHAND, MOVED_KEYS, REWARDS_SHORTHAND, replaced_key,
                                upgrade, yaml_key)
from gpurl.data import suites
from gpurl.models import families


def config_dir() -> Path:
    """configs/ ships inside the wheel as gpurl/configs; an editable install reads the repo's."""
    here = Path(gpurl.__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").exists():
            return candidate
    raise FileNotFoundError(f"gpurl's configs/ directory was not found next to {here}; reinstall gpurl.")


# ---------------------------------------------------------------- schema <-> dataclasses

def _schema(cls: type) -> Any:
    """Typed OmegaConf node for a dataclass, with keyword-safe field names renamed."""
    structured = OmegaConf.structured(cls)
    OmegaConf.set_readonly(structured, False)
    hints = typing.get_type_hints(cls)
    content = {}
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        content[yaml_key(f.name)] = (_schema(sub) if dataclasses.is_dataclass(sub)
                                      else structured._get_node(f.name))
    return DictConfig(content)


def to_config(cfg: Any, cls: type = Config) -> Any:
    """The one conversion: composed DictConfig -> frozen, validated `cls` (Config for train)."""
    converted = registry.parse(OmegaConf.to_container(cfg, resolve=True), cls, strict=True)
    families.get(converted.model.family)  # a bad model.family fails here, not mid-build
    if isinstance(converted, EvalConfig):  # and a bad suite name
        for name in converted.suite:
            suites.get(name)
    return converted


@dataclasses.dataclass(frozen=True)
class App:
    """A Hydra-composed subcommand: its name, root config file and schema."""

    name: str
    config_name: str
    schema: type


APPS = {"train": App("train", "config", Config),
        "plan": App("plan", "config", Config),  # gpurl train's config, planned not run
        "generate": App("generate", "generate", GenerateConfig),
        "eval": App("eval", "eval", EvalConfig),
        "serve": App("serve", "serve", ServeConfig)}


def app_groups(app: App) -> dict[str, list[str]]:
    """The config groups `app`'s root config composes (its defaults list), each with the
    options in configs/: what its command line can choose."""
    root = config_dir()
    return {g: sorted(p.stem for p in (root / g).glob("*.yaml")) for g in _default_choices(app)}


def _default_choices(app: App) -> dict[str, str]:
    """{group: option} of the app's root defaults list (configs/<app>.yaml)."""
    root = config_dir()
    defaults = yaml.safe_load((root / f"{app.config_name}.yaml").read_text())["defaults"]
    pairs = [next(iter(d.items())) for d in defaults if isinstance(d, dict)]
    return {g: o for g, o in pairs if (root / g).is_dir()}


def app_help(app: App) -> str:
    """`gpurl eval --help` / `gpurl generate --help`: the help text of the app's root config
    with only the groups that command takes (Hydra's own lists every directory of configs/)."""
    template = yaml.safe_load((config_dir() / f"{app.config_name}.yaml").read_text())[
        "hydra"]["help"]["template"]
    groups = "\n".join(f"{g}: {', '.join(options)}" for g, options in app_groups(app).items())
    return template.replace("$APP_CONFIG_GROUPS", groups)


# What `gpurl eval checkpoint=RUN` takes from the run unless the command line names it.
RUN_TASK = ("data", "rollout", "rewards", "env")


def inherit_run_task(cfg: DictConfig, overrides: Sequence[str],
                     choices: dict[str, Any]) -> list[str]:
    """`gpurl eval checkpoint=RUN`: the run's own task. Each of data, rollout, rewards and
    env comes from the run's config.yaml unless the command line chose it (`data=gsm8k`,
    or `env=calculator`, whose preset chooses data and rollout; rewards score the data, so
    other data leaves the run's rewards out too); keys set inside a section
    the run gives (`rollout.max_new_tokens=1024`) apply on top of the run's. Changes `cfg`
    in place; returns the sections taken from the run. A directory without config.yaml is
    left to the command (one sentence naming it)."""
    run_file = Path(cfg.checkpoint) / "config.yaml"
    if not run_file.is_file():
        return []
    try:
        run = upgrade(yaml.safe_load(run_file.read_text()) or {})
    except yaml.YAMLError:
        return []  # the command's read of the run says what is wrong with the file
    keys = [re.sub(r"^[+~]*", "", o).partition("=")[0] for o in overrides]
    defaults = _default_choices(APPS["eval"])
    taken: list[str] = []
    for section in RUN_TASK:
        chosen = section in keys or (section in defaults
                                     and str(choices.get(section)) != defaults[section])
        if section == "rewards" and "data" not in taken:
            chosen = True
        if chosen or not isinstance(run.get(section), dict):
            continue
        inside = {k: OmegaConf.select(cfg, k) for k in keys if k.startswith(section + ".")}
        cfg[section] = run[section]
        for key, value in inside.items():
            OmegaConf.update(cfg, key, value, merge=False)
        taken.append(section)
    return taken


def register_schemas() -> None:
    store = ConfigStore.instance()
    for app in APPS.values():
        store.store(name=f"gpurl_{app.config_name}_schema", node=_schema(app.schema))
    for schema in registry.schemas():
        store.store(name=f"gpurl_{schema.schema}", node=_schema(schema))


# ---------------------------------------------------------------- moved keys

def upgrade_overrides(overrides: Sequence[str],
                      notice: Callable[[str], None] | None = None) -> list[str]:
    """Overrides with moved keys renamed (each with a one-line notice), `rewards=[...]`
    read as `rewards.functions=[...]` and `suite=gsm8k` as `suite=[gsm8k]`; a replaced key
    raises ConfigError naming its successor (`gpurl.config.dicts.REPLACED_KEYS`)."""
    notice = notice or (lambda text: print(text, file=sys.stderr, flush=True))
    short, full = REWARDS_SHORTHAND
    out = []
    for override in overrides:
        prefix = re.match(r"[+~]*", override).group()
        key, sep, value = override[len(prefix):].partition("=")
        refused = replaced_key(key, value)
        if refused is not None:
            raise ConfigError(refused)
        if key == short and sep:
            key = full
        elif key in MOVED_KEYS:
            notice(f"[gpurl] {key} is deprecated and will be removed; use {MOVED_KEYS[key]} "
                   f"(set to the same value now).")
            key = MOVED_KEYS[key]
        elif key in LIST_SHORTHAND and sep and not value.lstrip().startswith("["):
            value = f"[{value}]"
        out.append(prefix + key + sep + value)
    return out


# ---------------------------------------------------------------- clear errors

def _known_keys(schema: type) -> list[str]:
    keys = []
    for group, sec in OmegaConf.to_container(_schema(schema)).items():
        keys += [f"{group}.{key}" for key in sec] if isinstance(sec, dict) else [group]
    if schema is Config:
        keys += sorted({f"algo.{yaml_key(f.name)}" for s in registry.schemas()
                        for f in dataclasses.fields(s)})
    return keys


def _other_algorithms(full_key: str) -> list[str]:
    """The algorithms whose schema has `algo.<key>`."""
    group, _, key = full_key.partition(".")
    if group != "algo":
        return []
    return [a.name for a in registry.ALGORITHMS.values()
            if key in {yaml_key(f.name) for f in dataclasses.fields(a.config)}]


def _explain(exc: BaseException, overrides: Sequence[str], app: App) -> str:
    """One sentence for a Hydra/OmegaConf composition error."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for e in chain:
        if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and getattr(e, "full_key", None):
            owners = _other_algorithms(e.full_key)
            if owners:
                return (f"'{e.full_key}' is not a key of the chosen algorithm; it is one of "
                        f"algo={', '.join(owners)}: choose one of those or drop the key.")
            guess = difflib.get_close_matches(e.full_key, _known_keys(app.schema), n=1)
            hint = f"did you mean '{guess[0]}'? " if guess else ""
            return (f"unknown config key '{e.full_key}'; {hint}"
                    f"run `gpurl {app.name} --cfg job` to list every key.")
        if isinstance(e, ValidationError) and getattr(e, "full_key", None):
            first = str(e).splitlines()[0]
            return f"bad value for '{e.full_key}': {first}; fix the value on the command line."
        if isinstance(e, MissingConfigException):
            options = getattr(e, "options", None) or []
            missing = getattr(e, "missing_cfg_file", "") or ""
            group, _, option = missing.rpartition("/")
            return (f"{group}={option} is not a known option"
                    + (f"; use one of: {', '.join(sorted(options))}." if options
                       else "; `gpurl train --help` lists the config groups."))
        if isinstance(e, OverrideParseException):
            return f"could not parse the override: {str(e).splitlines()[0]}; write it as key=value."
    return f"{str(exc).splitlines()[0]}; check the overrides {list(overrides)}."


def _validation_sets(overrides: list[str]) -> list[list[str]]:
    """For a sweep, one override list per swept value (others at their first value)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [o.input_line if not o.is_sweep_override() else
            f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" for o in parsed]
    sets = [base]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                sets.append(base[:i] + [f"{o.get_key_element()}={value}"] + base[i + 1:])
    return sets


def quote_free_text(arg: str) -> str:
    """`prompt=12 + 7 =` is free text, not Hydra grammar: pass it as one quoted string."""
    key, sep, value = arg.partition("=")
    if key != "prompt" or not sep or (value[:1] in "'\"" and value[-1:] == value[:1] and value):
        return arg
    escaped = value.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${")
    return f"prompt='{escaped}'"


def validate(overrides: list[str], app: App = APPS["train"]) -> Any:
    """Composes the config as Hydra will and converts it; raises ConfigError with one sentence."""
    register_schemas()
    user = upgrade_overrides([quote_free_text(o) if app.name == "generate" else o
                              for o in overrides
                              if not o.startswith("hydra") and not o.startswith("-")])
    try:
        sets = _validation_sets(user)
    except Exception as e:  # noqa: BLE001 - Hydra's parser raises several types
        raise ConfigError(_explain(e, user, app)) from None
    cfg = None
    for values in sets:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="gpurl"):
            try:
                composed = compose(app.config_name, overrides=values, return_hydra_config=True)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(_explain(e, values, app)) from None
            # ${hydra:runtime.choices.data} (run.dir) resolves as in a real run
            HydraConfig.instance().set_config(composed)
            choices = OmegaConf.to_container(composed.hydra.runtime.choices)
            with open_dict(composed):
                del composed["hydra"]
            if app.name == "eval" and composed.checkpoint is not None:
                inherit_run_task(composed, values, choices)
            converted = to_config(composed, app.schema)
            cfg = cfg or converted
    GlobalHydra.instance().clear()
    return cfg
