"""Every check a start runs before it builds anything, as functions of the config and the
job's shape (processes x devices each): `gpurl train` runs `train_checks` first (as
`gpurl eval` runs `eval_checks`, `gpurl generate` `generate_checks`), and `gpurl check`
runs the same functions for a job it describes, without loading a model or touching a
device. One code path, so a check and a start cannot drift (`tests/test_first_hour.py`
holds every start-up refusal of the suite's bad-input tests to it).

What is checked: the trainer and rollout meshes over the job's devices, batch sizes
against processes and batch shards (`fit_batch`), placement and rollout mode, the files
the config names (weights, data rows, teacher, reward model, suites, run directories,
prompt files), reward functions and environments (user code is imported). Memory is
`gpurl plan`'s question (a start checks it after compiling, `plan.check`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import yaml

from gpurl import hub
from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.config import Config, ConfigError, EvalConfig, GenerateConfig, ModelConfig
from gpurl.data import suites
from gpurl.data.preferences import load_pairs
from gpurl.data.sources import default_rewards, load_examples, load_prompts
from gpurl.distributed.mesh import batch_shards, mesh_sizes, rollout_per_process, rollout_shards
from gpurl.models import loading
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.multiturn import EnvFactory
from gpurl.rollout.sources import check_mode
from gpurl.rollout.suites import load_rows as load_suite_rows
from gpurl.serve.agents import check_agent

# The rows each family's stepper reads (train, held-out): read by the check as by the start.
DATA: dict[Family, Callable[[Any], tuple]] = {
    Family.RL: load_prompts, Family.SFT: load_examples, Family.PREFERENCE: load_pairs}


def check_target(cfg: Config) -> None:
    if cfg.plan.target:
        raise ConfigError(f"plan.target={cfg.plan.target} compiles for a GPU without running "
                          f"anything, so it is for `gpurl plan`; drop it from gpurl train.")


def check_context(cfg: Config, algorithm: registry.Algorithm) -> None:
    """The context axis splits packed rows: RL and preference runs need train.packed
    (SFT's rows are packed by data.packing). And train.suites: known names, sampled by an
    RL run's rollout engine (other runs have none)."""
    if (cfg.mesh.context_width or 1) > 1 and algorithm.family != Family.SFT and not cfg.train.packed:
        raise ConfigError(f"mesh.context={cfg.mesh.context} splits packed rows; set "
                          f"train.packed=true (or mesh.context=1).")
    for name in cfg.train.suites:
        suites.get(name)
    if cfg.train.suites and algorithm.family != Family.RL:
        raise ConfigError(f"train.suites samples the policy during RL runs, not during "
                          f"algo={cfg.algo.name}'s; drop train.suites and evaluate the run "
                          f"afterwards with `gpurl eval checkpoint=RUN suite=...`.")
    if cfg.env.agents and algorithm.family != Family.RL:
        raise ConfigError(f"env=agent plays RL trajectories, not algo={cfg.algo.name}'s "
                          f"batches; choose an RL algorithm (algo=grpo) or drop env=agent.")


def check_experts(model: ModelConfig, shape: dict[str, int], rules: Any) -> None:
    """Experts split evenly over the mesh axes (sizes `shape`) the `expert` rule maps them to."""
    axes = [a for a in rules.get("expert", ()) if shape[a] > 1]
    size = math.prod(shape[a] for a in axes)
    if model.moe.num_experts and model.moe.num_experts % size:
        raise ConfigError(
            f"model.moe.num_experts={model.moe.num_experts} does not split over the "
            f"{size} devices of mesh axes {'x'.join(axes)}; choose mesh.expert dividing "
            f"{model.moe.num_experts}.")


def _group(cfg: Config, family: Family) -> int:
    """Rows per batch entry: an RL prompt's G completions (x env.agent_rows), else 1."""
    if family != Family.RL:
        return 1
    return cfg.algo.num_generations * (cfg.env.rows_per_trajectory if cfg.env.agents else 1)


def _fits(cfg: Config, family: Family, shards: int, processes: int, rollout: int
          ) -> tuple[list[str], int, int]:
    """(what the batch does not split over, and the smallest batch and micro-batch at least
    as large that split over everything: the same when nothing is wrong)."""
    train, group = cfg.train, _group(cfg, family)

    def problems(size: int, micro: int) -> list[str]:
        out = []
        if size % processes:
            out.append(f"the {processes} processes")
        if size % micro or micro % shards:
            out.append(f"the {shards} batch shards of the trainer mesh")
        if family == Family.RL and size * group % rollout:
            out.append(f"the {rollout} data shards of the rollout mesh")
        return out

    micro = train.micro_batch_size or train.batch_size
    wrong = problems(train.batch_size, micro)
    unit = math.lcm(processes, shards, rollout)
    if not wrong:
        return [], train.batch_size, micro
    for size in range(train.batch_size, train.batch_size + unit * max(micro, 1) + 1):
        if train.micro_batch_size:
            fits = [m for m in range(micro, size + 1) if size % m == 0 and not problems(size, m)]
            if fits:
                return wrong, size, fits[0]
        elif not problems(size, size):
            return wrong, size, size
    return wrong, unit, unit


def fit_batch(cfg: Config, family: Family, shards: int, processes: int = 1,
              rollout: int = 1) -> None:
    """A step's batch splits evenly: its entries (`train.batch_size`: prompts for RL, rows
    else) over the processes and, per micro-batch, over the trainer mesh's `shards` batch
    shards (an RL prompt's G completions stay on one shard, so that group statistics need no
    traffic), and an RL step's rows (prompts x G) over the `rollout` mesh's data shards.
    Else one sentence naming every key to change, with values that work."""
    wrong, size, micro = _fits(cfg, family, shards, processes, rollout)
    if not wrong:
        return
    train = cfg.train
    fix = f"train.batch_size={size}" + (f" train.micro_batch_size={micro}"
                                        if train.micro_batch_size else "")
    what = (f"train.batch_size={train.batch_size} prompts (x {_group(cfg, family)} completions "
            f"each)" if family == Family.RL else f"train.batch_size={train.batch_size} rows")
    per_micro = (f" in micro-batches of train.micro_batch_size={train.micro_batch_size}"
                 if train.micro_batch_size else "")
    raise ConfigError(f"{what}{per_micro} must split evenly over {' and '.join(wrong)}; set "
                      f"{fix} (or change mesh.data/mesh.fsdp/mesh.expert).")


def default_batch(cfg: Config, processes: int, devices: int) -> tuple[Config, str | None]:
    """A preset's batch (the command line named no train.batch_size) raised to the smallest
    that the job splits evenly, and the line that says so; a batch the user named is never
    changed (`fit_batch` then names the value that fits)."""
    algorithm = registry.get(cfg.algo.name)
    shape, shards, replicas = _job_mesh(cfg, algorithm, processes, devices)[:3]
    wrong, size, micro = _fits(cfg, algorithm.family, shards, processes, replicas)
    if not wrong:
        return cfg, None
    train = dataclasses.replace(cfg.train, batch_size=size,
                                micro_batch_size=micro if cfg.train.micro_batch_size else 0)
    unit = "prompts" if algorithm.family == Family.RL else "rows"
    return dataclasses.replace(cfg, train=train), (
        f"train.batch_size: the preset's {cfg.train.batch_size} {unit} -> {size}, the smallest "
        f"count that splits evenly over {' and '.join(wrong)} (name train.batch_size to choose)")


def _job_mesh(cfg: Config, algorithm: registry.Algorithm, processes: int, devices: int
              ) -> tuple[dict[str, int], int, int, list[str]]:
    """(the trainer mesh's axis sizes, its batch shards, the rollout's data shards: 1 for
    runs without one, lines) of the job; split placement divides its devices."""
    total = processes * devices
    lines = []
    trainer, rollout = total, total
    if algorithm.family == Family.RL and cfg.mesh.placement == "split":
        per = rollout_per_process(cfg.mesh, [devices] * processes)
        trainer, rollout = total - per * processes, per * processes
        lines.append(f"placement: split, {rollout} rollout and {trainer} trainer devices")
    shape = mesh_sizes(cfg.mesh, trainer)
    replicas = rollout_shards(cfg.mesh, rollout) if algorithm.family == Family.RL else 1
    return shape, batch_shards(shape, cfg.mesh.train_rules), replicas, lines


def eval_batch(cfg: Config, shards: int, processes: int = 1) -> Config:
    """train.eval_batch_size rounded up to a multiple of the batch shards and processes (an
    eval batch is a forward pass's width, not part of the figures: its padding rows count
    nowhere), so the default fits any mesh."""
    unit = math.lcm(shards, processes)
    size = -(-cfg.train.eval_batch_size // unit) * unit
    if size == cfg.train.eval_batch_size:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batch_size=size))


def train_checks(cfg: Config, processes: int, devices: int, planning: bool = False) -> list[str]:
    """The checks of a `gpurl train` start (`planning`: of `gpurl plan`'s, which takes
    plan.target and reads no data) for a job of `processes` x `devices`; one line per check
    passed, ConfigError at the first failure."""
    if not planning:
        check_target(cfg)
    algorithm = registry.get(cfg.algo.name)
    check_context(cfg, algorithm)
    if algorithm.family == Family.RL:
        check_mode(cfg.rollout, cfg.mesh.placement)
    shape, shards, replicas, lines = _job_mesh(cfg, algorithm, processes, devices)
    fit_batch(cfg, algorithm.family, shards, processes, replicas)
    cfg = eval_batch(cfg, shards, processes)
    check_experts(cfg.model, shape, cfg.mesh.train_rules)
    lines.append(f"trainer mesh {shape}, micro-batch {cfg.train.batch_size // cfg.train.num_micro_batches} "
                 f"x {cfg.train.num_micro_batches}, eval batch {cfg.train.eval_batch_size}")
    if algorithm.family == Family.RL:
        lines.append(f"rollout: {cfg.train.batch_size} prompts x {cfg.algo.num_generations} "
                     f"over {processes} process(es) and {replicas} data shard(s)"
                     + (" (mesh.rollout_tp=auto taken as 1)" if cfg.mesh.rollout_width is None
                        else ""))
    lines.append(model_line(cfg.model))
    for key in ("teacher", "reward_model"):
        path = getattr(cfg.algo, key, None)
        if path is not None:
            lines.append(exists(f"algo.{key}", path))
    if not planning:
        lines += resume_lines(cfg)
        lines += data_lines(cfg.data, DATA[algorithm.family])
        lines += suite_lines(cfg.train.suites, None, cfg.train.suites_limit, "train.suites")
    if algorithm.family == Family.RL:
        lines += task_lines(cfg)
        if cfg.rollout.ignore_eos:
            lines.append("warning: rollout.ignore_eos=true (a benchmark setting): every completion "
                         "runs to its length limit past the end-of-sequence token, and is trained "
                         "on so; drop it for a real run.")
    return lines


# The model settings a checkpoint's parameter shapes follow.
SHAPED = ("family", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
          "head_dim", "mlp_dim", "tie_embeddings", "qkv_bias", "qk_norm", "post_norms")


def resume_lines(cfg: Config) -> list[str]:
    """A run.dir with checkpoints is resumed: refused when its config.yaml records a model
    whose parameters have other shapes than this one's (weights read from the cache only)."""
    run = Path(cfg.run.dir).absolute()
    steps = [p.name for p in (run / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps or not (run / "config.yaml").is_file():
        return []
    named = loading.weights_name(cfg.model)
    if named is not None and not hub.cached(named[0], "model_meta"):
        return [f"run.dir: resumes {run} from step {max(map(int, steps))}"]
    before = yaml.safe_load((run / "config.yaml").read_text()).get("model") or {}
    now = dataclasses.asdict(loading.resolve(cfg.model))
    pairs = [(k, before.get(k), now[k]) for k in SHAPED]
    pairs += [(f"{group}.{k}", (before.get(group) or {}).get(k), now[group][k])
              for group, k in (("lora", "rank"), ("moe", "num_experts"))]
    changed = [f"model.{k}: {a!r} -> {b!r}" for k, a, b in pairs if a is not None and a != b]
    if changed:
        raise ConfigError(
            f"the checkpoint at {run}/checkpoints/{max(map(int, steps))} was written for another "
            f"model or optimizer ({', '.join(changed)}); set a new run.dir, or rerun with the config the run was "
            f"started with ({run}/config.yaml).")
    return [f"run.dir: resumes {run} from step {max(map(int, steps))}"]


def eval_checks(cfg: EvalConfig, processes: int, devices: int) -> list[str]:
    """The checks of a `gpurl eval` start: the weights, the mesh, the suites' rows or the
    data's held-out rows, the rewards and environment."""
    lines = [run_dir(cfg.checkpoint) if cfg.checkpoint is not None else model_line(cfg.model)]
    rollout_shards(cfg.mesh, processes * devices)
    if cfg.suite:  # the suites' own rows and scorers (names checked by `to_config`)
        return lines + suite_lines(cfg.suite, cfg.suite_path, cfg.limit, "suite")
    return lines + data_lines(cfg.data, load_prompts) + task_lines(cfg)


def generate_checks(cfg: GenerateConfig, processes: int, devices: int) -> list[str]:
    lines = [run_dir(cfg.checkpoint) if cfg.checkpoint is not None else model_line(cfg.model)]
    rollout_shards(cfg.mesh, processes * devices)
    if cfg.prompts_file is not None:
        lines.append(prompts_file_line(cfg.prompts_file))
    if cfg.env.on:
        EnvFactory(cfg.env)
        lines.append(f"env: {cfg.env.name}")
        if cfg.prompt is None and cfg.prompts_file is None:
            lines += data_lines(cfg.data, load_prompts)
    return lines


def model_line(model: ModelConfig) -> str:
    """The weights a start would load, read from the cache only (nothing is fetched)."""
    named = loading.weights_name(model)
    if named is not None and not hub.is_hub_id(named[0]):
        named = (loading.checkpoint_path(model), named[1])
    return (f"model: {model.name}, "
            + (f"weights {hub.describe(*named)}" if named else "random weights"))


def exists(key: str, path: str) -> str:
    if hub.is_hub_id(path):
        return f"{key}: {hub.describe(path, key)}"
    if not Path(path).expanduser().exists():
        raise ConfigError(f"{key}={path} does not exist; point it at an existing path.")
    return f"{key}: {hub.describe(path, key)}"


def prompts_file_line(path: str) -> str:
    """`gpurl generate`'s prompts_file: an existing jsonl or text file."""
    if not Path(path).is_file():
        raise ConfigError(f"prompts_file={path} does not exist; point it to a jsonl or text file.")
    return f"prompts_file: {path}"


def run_dir(path: str) -> str:
    if not (Path(path) / "config.yaml").is_file():
        raise ConfigError(f"{path} holds no config.yaml; point checkpoint= at a gpurl run "
                          f"directory.")
    return f"checkpoint: run {path}"


def data_lines(data: Any, read: Callable[[Any], tuple]) -> list[str]:
    """The data's files or dataset, and its rows read as the start reads them (`read`):
    a damaged file, a missing column or data.num_eval past the rows stop here."""
    lines = [exists(f"data.{key}", getattr(data, key)) for key in ("path", "eval_path")
             if getattr(data, key) is not None]
    if data.dataset is not None and data.path is None:
        lines.append(f"data.dataset: {hub.describe(data.dataset, 'data.dataset', 'dataset')}")
        if not hub.cached(data.dataset, "dataset"):
            return lines  # fetched at start: its rows are read then
    train, held_out = read(data)
    return lines + [f"data: {len(train)} training rows, {len(held_out)} held out"]


def suite_lines(names: Any, path: str | None, limit: int, key: str) -> list[str]:
    """The suites' rows, read as the start reads them (a damaged suite_path, a dataset the
    offline cache lacks stop here); a dataset to be fetched at the start is only named."""
    lines = []
    for name in names:
        dataset = suites.get(name).dataset
        if path is None and not hub.offline() and not hub.cached(dataset, "dataset"):
            lines.append(f"{key} {name}: {hub.describe(dataset, key, 'dataset')}")
            continue
        rows = load_suite_rows([name], path, limit, offer_path=key != "train.suites")[name]
        lines.append(f"{key} {name}: {len(rows)} problems")
    return lines


def task_lines(cfg: Any) -> list[str]:
    """The reward functions import and the environment (and its tools) or the agent load."""
    rewards = load_rewards(cfg.rewards, [] if cfg.env.on else default_rewards(cfg.data))
    lines = [f"rewards: {', '.join(r.name for r in rewards) or 'the environment'}"]
    if cfg.env.agents:
        lines.append(f"env: agent {check_agent(cfg.env)}")
    elif cfg.env.on:
        EnvFactory(cfg.env)
        lines.append(f"env: {cfg.env.name}")
    return lines
