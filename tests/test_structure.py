"""The structure ARCHITECTURE.md asks for, read off the code: imports run one way (no
circle, no import hidden in a function, config.py a leaf), an algorithm's name is compared
only in its registry record, every choice has its registered function, every record has a
preset naming its schema, and every model family is a file of models/families/."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from conftest import algo_config
from gpurl.algorithms import registry
from gpurl.algorithms.dpo import DPO_LOSSES
from gpurl.algorithms.behaviour import BEHAVIOUR_RATIOS
from gpurl.algorithms.policy_gradient import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, RATIOS
from gpurl.cli import validate
from gpurl.config import ConfigError, GRPOConfig, RolloutConfig
from gpurl.models import families
from gpurl.train import loop

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpurl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(gpurl modules imported at module level, imports of gpurl inside functions)."""
    tree = ast.parse(path.read_text())
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    top, local = set(), []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        names = [n for n in names if n.split(".")[0] == "gpurl"]
        if names and id(node) in inner:
            local.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        top.update(names)
    return top, local


# The layers of ../shared/ARCHITECTURE.md (Boundaries), lowest first: a module imports only
# from its own layer or lower ones (the models read the logical-axis rules from
# gpurl/models/axes.py, never from distributed/).
LAYERS = [("config", "glossary", "user_code", "buckets"), ("kernels",), ("models",), ("distributed",),
          ("data", "envs", "rewards"), ("rollout", "algorithms"), ("train",), ("commands",),
          ("cli",)]


def _layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_imports_run_one_way_with_no_circle_and_none_inside_functions():
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges, hidden = {}, []
    for name, path in modules.items():
        top, local = _imports(path)
        hidden += local
        # a package's face importing its own modules is not a dependency of theirs
        edges[name] = {r for r in map(resolve, top) if r and r != name
                       and not name.startswith(r + ".")}
    assert not hidden, f"gpurl imports inside functions: {hidden}"
    # the config package imports nothing from gpurl outside itself, and its value checks
    # nothing at all: every other module may import it
    config = {m for m in edges if m == "gpurl.config" or m.startswith("gpurl.config.")}
    outside = sorted(f"{m} -> {t}" for m in config for t in edges[m] if t not in config)
    assert not outside and not edges["gpurl.config.checks"], (
        f"gpurl/config/ must import nothing from gpurl outside itself: {outside}")
    upward = [f"{m} -> {t}" for m in edges for t in edges[m]
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert not upward, f"imports against the layers (LAYERS, lowest first): {upward}"
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_algorithm_names_are_compared_only_in_the_registry():
    names = "|".join(registry.ALGORITHMS)
    comparison = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if path.name != "registry.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if comparison.search(line)]
    assert not found, f"algorithm names compared outside gpurl/algorithms/registry.py: {found}"


@pytest.mark.parametrize("table", [KL_ESTIMATORS, LOSS_AGGS, ADVANTAGES, RATIOS, DPO_LOSSES,
                                   BEHAVIOUR_RATIOS],
                         ids=lambda t: t.what)
def test_every_choice_has_its_registered_function_and_bad_names_list_the_valid_ones(table):
    assert table.missing() == []
    with pytest.raises(ValueError, match=f"unknown {table.what} 'nope'; use one of: "
                                         f"{', '.join(table.names())}."):
        table["nope"]


def test_every_algorithm_has_a_preset_naming_its_schema():
    presets = {}
    for path in sorted((ROOT / "configs" / "algo").glob("*.yaml")):
        preset = yaml.safe_load(path.read_text())
        presets.setdefault(preset["name"], []).append((path.stem, preset["defaults"][0]))
    assert set(presets) == set(registry.ALGORITHMS)
    for name, found in presets.items():
        schema = registry.get(name).config.schema
        assert all(first == f"/gpurl_{schema}@_here_" for _, first in found), (name, found)
    assert registry.AlgoName.GRPO == "grpo" and len(registry.AlgoName) == len(registry.ALGORITHMS)


def test_each_family_is_one_file_and_unknown_ones_are_one_sentence():
    files = {p.stem for p in (PACKAGE / "models" / "families").glob("*.py")} - {"__init__", "base"}
    assert files == set(families.FAMILIES)
    with pytest.raises(ConfigError, match="model.family='mamba' is not valid; use one of: gemma, "):
        validate(["model.family=mamba"])


def test_a_key_of_another_algorithm_names_its_owners():
    with pytest.raises(ConfigError, match=r"^'algo.critic_lr' is not a key of the chosen "
                                          r"algorithm; it is one of algo=ppo: "):
        validate(["algo.critic_lr=1e-5"])
    with pytest.raises(ConfigError, match=r"algo=dpo has no key algo\.\w+ \(its keys are those of DPOConfig\)"):
        validate(["algo.name=dpo"])


def test_moved_keys_keep_working_with_a_notice(capsys):
    cfg = validate(["rewards=[numeric_match]", "rewards_on_error=zero", "reward_timeout_s=5"])
    assert (cfg.rewards.functions, cfg.rewards.on_error, cfg.rewards.timeout_s) == (
        ("numeric_match",), "zero", 5.0)
    notices = capsys.readouterr().err.strip().splitlines()
    assert notices == [f"[gpurl] {old} is deprecated and will be removed; use {new} (set to the "
                       f"same value now)." for old, new in (("rewards_on_error", "rewards.on_error"),
                                                           ("reward_timeout_s", "rewards.timeout_s"))]


def test_replaced_rollout_keys_name_the_mode_and_old_run_directories_read_as_it():
    for old, mode in (("rollout.async", "one_ahead"), ("rollout.continuous", "continuous")):
        with pytest.raises(ConfigError, match=rf"^{old} was replaced by rollout.mode; set "
                                              rf"rollout.mode={mode} \(one of sync, one_ahead, "
                                              rf"continuous\) instead\.$"):
            validate([f"{old}=true"])
    for rollout, mode in (({"async": True}, "one_ahead"), ({"async": False}, "sync"),
                          ({"continuous": True, "async": False}, "continuous"),
                          ({"continuous": False}, "sync")):
        assert registry.parse({"rollout": rollout}).rollout.mode == mode, rollout


def test_the_rollout_mode_is_read_in_one_module_of_rollout_which_imports_nothing_of_train():
    """`rollout.mode` reaches the RL step only through the batch-source protocol: one module
    reads it (a `.mode` off a RolloutConfig argument or a `.rollout` attribute), and nothing
    in gpurl/rollout/ imports gpurl/train/."""
    readers = set()
    for name, path in _modules().items():
        if name.startswith("gpurl.config"):
            continue
        tree = ast.parse(path.read_text())
        configs = {a.arg for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                   for a in fn.args.args + fn.args.kwonlyargs
                   if a.annotation is not None and "RolloutConfig" in ast.unparse(a.annotation)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "mode":
                owner = ast.unparse(node.value)
                if owner in configs or owner.split(".")[-1] == "rollout":
                    readers.add(name)
        if name.startswith("gpurl.rollout"):
            top, _ = _imports(path)
            assert not [m for m in top if m.startswith("gpurl.train")], (name, top)
    assert readers == {"gpurl.rollout.sources"}, readers


def test_a_config_yaml_written_before_the_split_still_reads(tmp_path):
    """Run directories of earlier versions hold every algorithm's keys in `algo` and the
    reward keys at the top level; `gpurl export`/`eval` of such a run still work, and
    resuming one reports what changed."""
    old_algo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    old_algo.update(name="grpo", beta=0.04, dpo_loss="sigmoid", critic="separate", gamma=1.0,
                    simpo_gamma=0.5, label_smoothing=0.0)
    cfg = registry.parse({"algo": old_algo, "rewards": ["numeric_match"], "reward_weights": [2.0],
                          "rewards_on_error": "zero", "reward_timeout_s": 5})
    assert cfg.algo == algo_config("grpo", beta=0.04)
    assert (cfg.rewards.functions, cfg.rewards.weights, cfg.rewards.on_error,
            cfg.rewards.timeout_s) == (("numeric_match",), (2.0,), "zero", 5)
    old = {"algo": old_algo, "rewards": ["numeric_match"], "reward_weights": [2.0]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    messages = []
    loop._prepare_run_dir(tmp_path, cfg, True, messages.append)
    assert len(messages) == 1 and "rewards.on_error: None -> 'zero'" in messages[0]
    assert "rewards.functions" not in messages[0]


def test_the_rl_step_is_a_short_pipeline_and_the_plan_matches_programs_by_kind():
    """`RLStepper` stays under 150 lines (its plan side lives in rl_programs.py); the plan,
    the account and the run's fitting find programs by `Kind`, never by comparing a display
    name; only a distillation objective declares that its loss takes the teacher."""
    tree = ast.parse((PACKAGE / "train/rl.py").read_text())
    stepper = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLStepper")
    assert stepper.end_lineno - stepper.lineno + 1 < 150, stepper.end_lineno - stepper.lineno + 1
    planning = [*sorted((PACKAGE / "plan").glob("*.py")), PACKAGE / "train/fitting.py",
                PACKAGE / "train/lowering.py"]
    for path in planning:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq))
                                                     for op in node.ops):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
                text = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
                assert not (named and text), (path.name, ast.unparse(node))
    takes = {name for name, record in registry.ALGORITHMS.items()
             if record.objective(algo_config(name), RolloutConfig()).takes_teacher}
    assert takes == {name for name, record in registry.ALGORITHMS.items() if record.distills}
