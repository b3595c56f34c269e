"""The schemas of the training run's groups (optim, train, rollout, mesh, logger, run,
distributed, rewards, plan), the root `Config` that holds every group, and the roots of
`gpurl generate` and `gpurl eval`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Optional

from gpurl.config.checks import ConfigError
from gpurl.config.checks import choice as _choice, positive as _positive, tuplify as _tuplify
from gpurl.config.algo import AlgoConfig, SFTConfig
from gpurl.config.data import DataConfig
from gpurl.config.env import EnvConfig
from gpurl.config.model import ModelConfig


# ---------------------------------------------------------------- choice enums


class LoggerName(str, enum.Enum):
    CONSOLE = "console"
    WANDB = "wandb"
    TENSORBOARD = "tensorboard"


class Placement(str, enum.Enum):
    COLOCATED = "colocated"
    SPLIT = "split"


class RolloutMode(str, enum.Enum):
    """Where an RL step's batch comes from (`gpurl.rollout.sources`)."""

    SYNC = "sync"  # each step samples its batch, then trains on it
    ONE_AHEAD = "one_ahead"  # step s+1's first round is sampled while step s trains
    CONTINUOUS = "continuous"  # the engine never stops; weights swapped in flight


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # peak learning rate of AdamW
    warmup_steps: int = 10  # linear warm-up from 0 to optim.lr
    decay: str = "cosine"  # after warm-up: cosine (to optim.min_lr_ratio * lr) or constant
    min_lr_ratio: float = 0.1  # final lr of the cosine decay, as a fraction of optim.lr
    weight_decay: float = 0.0  # decoupled weight decay (not applied to norms and biases)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.999  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 = no clipping
    # model.dtype=float16 only: dynamic loss scaling (the defaults of PyTorch's GradScaler): the
    # loss is multiplied by the scale before the backward pass; an overflow skips the update
    # and halves the scale, loss_scale_growth_every finite steps in a row double it
    loss_scale_init: float = 65536.0  # the first scale (2^16)
    loss_scale_growth_every: int = 2000  # finite steps in a row after which the scale doubles
    # regexes over parameter paths like "embed" or "blocks/mlp/up" (the layers are stacked,
    # so a block path names that parameter in every layer): matching parameters are not trained (no gradient, no optimizer state); [] = train everything
    freeze: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _choice("optim.decay", self.decay, ("cosine", "constant"))
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _tuplify(self)
        _positive("optim.loss_scale_init", self.loss_scale_init)
        _positive("optim.loss_scale_growth_every", self.loss_scale_growth_every)
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"optim.freeze pattern {pattern!r} is not a valid regular "
                                  f"expression ({e}); fix the pattern.") from None


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # global batch: examples (SFT) or prompts (RL) per step
    micro_batch_size: int = 0  # examples per gradient-accumulation micro-batch; 0 = batch_size
    seed: int = 0  # seed of the init, the data order and sampling
    eval_every: int = 100  # evaluate every N steps (and at the end); 0 = only at the end
    eval_batch_size: int = 64  # rows per eval forward pass (RL presets: 128), rounded up to a multiple of the batch shards and processes
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the end); 0 = only at the end
    save_final: bool = True  # save a checkpoint after the last step; false with checkpoint_every=0: none at all (benchmarks, throwaway sweeps)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    log_every: int = 1  # write metrics every N steps
    eval_pass_k: int = 4  # RL eval: samples per held-out prompt for pass@k (rollout temperature); 0 = greedy only
    # RL: standard suites evaluated during training, logged as eval/<suite>/avg@n and
    # eval/<suite>/pass@k in every logger: gsm8k, math500, aime2024, aime2025, gpqa_diamond
    # (docs/evaluation.md); e.g. train.suites=[gsm8k,math500]
    suites: list[str] = field(default_factory=list)
    suites_every: int = 0  # evaluate the suites every N steps (and before the first and after the last); 0 = with every held-out evaluation (train.eval_every)
    suites_samples: int = 1  # samples per suite problem at rollout.temperature (the n of avg@n)
    suites_limit: int = 0  # only the first N problems of each suite; 0 = all
    # a NaN or infinite loss or gradient norm: stop (end the run naming the step; the last
    # checkpoint stays the newest) or skip (leave that update out, count it in nonfinite_skipped)
    on_nonfinite: str = "stop"
    # RL and preference pairs: every pass of the step (reference, old policy, critic, reward
    # model, policy) runs on packed rows: completions end to end, each group's prompt once
    # per row, no padding slots beyond bucket rounding; false = the padded P x G x N layout
    packed: bool = True
    # packed: tokens per micro-batch on each device (rows of the batch's row length that
    # fit, a row counting its share Z / mesh.context; at least one row); 0 = auto: as many
    # as one padded micro-batch holds (micro_batch_size x G x (prompt width + completion
    # width) / batch shards; pairs: G = 2), lowered by the memory plan until the train step
    # fits (plan.check)
    micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        _tuplify(self)
        _choice("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        for key in ("steps", "batch_size", "eval_batch_size", "keep_checkpoints", "log_every",
                    "suites_samples"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("micro_batch_size", "eval_every", "checkpoint_every", "eval_pass_k",
                    "micro_batch_tokens", "suites_every", "suites_limit"):
            _positive(f"train.{key}", getattr(self, key), allow_zero=True)
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not a multiple of "
                f"train.micro_batch_size={micro}; choose a micro-batch size that divides it.")

    @property
    def num_micro_batches(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)


@dataclass(frozen=True)
class RolloutConfig:
    max_new_tokens: int = 64  # completion length limit
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    stop: list[str] = field(default_factory=list)  # stop strings besides EOS; "\n" and "\t" mean newline and tab
    # decode past EOS: every completion runs to rollout.max_new_tokens unless a rollout.stop
    # string ends it (throughput benchmarks: vLLM's SamplingParams.ignore_eos); a training run
    # then learns from text after EOS, so keep it off for real training
    ignore_eos: bool = False
    slots: int = 64  # requests decoding at once per rollout data shard; the rest wait in a queue
    block_size: int = 64  # tokens per block of the paged KV cache
    # KV cache cap per data shard, in tokens; 0 = auto: the requests' worst case, capped by
    # the memory plan (plan.check) to what fits beside the weights (fewer rows decode at once)
    kv_cache_tokens: int = 0
    decode_chunk: int = 16  # decode steps per device call between two scheduling rounds
    # prompt tokens a prefill computes at once per request (a power of two, >= 16): a longer
    # prompt or multi-turn trajectory runs in chunks of this many, each attending to the keys
    # and values of those before it, so no activation spans the whole sequence
    prefill_chunk: int = 4096
    # keep full KV blocks after their requests finish, keyed by their tokens and the policy
    # version that computed them: a later request with the same prefix (a group's other
    # completions, a multi-turn trajectory's next turn, a preempted request) computes only
    # the rest (docs/environments.md, docs/distributed.md: prefix cache)
    prefix_cache: bool = True
    # sync: each step samples, then trains; one_ahead: step s+1's first round is sampled while
    # step s trains (split placement); continuous: the engine never stops, new weights enter
    # between decode chunks and each step trains the first groups that finish (split
    # placement; docs/distributed.md, three rollout modes)
    mode: str = "sync"
    max_lag: int = 2  # continuous: tokens trained are at most this many policy versions old (a group is trained when its oldest token reaches it)
    # continuous: 0 = new weights enter at the first decode chunk after they are ready; N = after
    # exactly N scheduling iterations of each step (a deterministic, bit-reproducible schedule)
    swap_chunks: int = 0
    in_flight: int = 2  # continuous: batches of prompts kept queued or decoding (at most max_lag)

    def __post_init__(self) -> None:
        _tuplify(self)
        # The command line passes backslash escapes literally; stop strings mean the characters.
        object.__setattr__(self, "stop", tuple(
            s.replace("\\n", "\n").replace("\\t", "\t") for s in self.stop))
        if any(s == "" for s in self.stop):
            raise ConfigError("rollout.stop holds an empty string; remove it or give the text to stop at.")
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p} is not valid; use a value in (0, 1].")
        _positive("rollout.top_k", self.top_k, allow_zero=True)
        for name in ("slots", "block_size", "decode_chunk"):
            _positive(f"rollout.{name}", getattr(self, name))
        _positive("rollout.kv_cache_tokens", self.kv_cache_tokens, allow_zero=True)
        chunk = self.prefill_chunk
        if not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
            raise ConfigError(f"rollout.prefill_chunk={chunk} is not valid; use a power of two "
                              f"of at least 16 (prompts are padded to powers of two).")
        _positive("rollout.max_lag", self.max_lag, allow_zero=True)
        _positive("rollout.swap_chunks", self.swap_chunks, allow_zero=True)
        _positive("rollout.in_flight", self.in_flight)
        _choice("rollout.mode", self.mode, RolloutMode)
        continuous = self.mode == RolloutMode.CONTINUOUS.value
        if continuous and self.max_lag == 0:
            raise ConfigError("rollout.max_lag=0 lets continuous mode train no token sampled "
                              "before a step's weights, so nothing overlaps; set "
                              "rollout.max_lag>=1 or rollout.mode=one_ahead.")
        if continuous and self.in_flight > self.max_lag:
            # a group first sampled before a step's weight swap is a version old, so it has
            # max_lag steps to be trained; more batches in flight than that cannot all be
            # and would be sampled again at every step (docs/distributed.md)
            raise ConfigError(
                f"rollout.in_flight={self.in_flight} is more than rollout.max_lag="
                f"{self.max_lag}: continuous mode trains at most max_lag batches of groups "
                f"within the bound, so the others would be sampled again at every step; set "
                f"rollout.in_flight<={self.max_lag} or rollout.max_lag>={self.in_flight}.")


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # trainer data-parallel axis; -1 = all devices left over
    fsdp: int = 1  # trainer fully-sharded axis (parameters and optimizer state sharded)
    tp: int = 1  # trainer tensor-parallel axis
    expert: int = 1  # trainer expert-parallel axis: a mixture-of-experts model's experts are split over it (batch rows too)
    # trainer context-parallel axis: every packed row's tokens are split over it (each device
    # a balanced share of the causal attention; keys and values all-gathered per layer), and
    # parameters with them like fsdp; for sequences longer than one device's activations hold.
    # A power of two up to 32, -1 to fill, or auto: 1, unless the train step's memory plan
    # with one row per micro-batch does not fit a device; then the narrowest width that fits,
    # its devices taken from mesh.fsdp, then mesh.data (the plan says which)
    context: str = "auto"
    placement: str = "colocated"  # colocated (rollout and trainer share devices) or split
    rollout_devices: int = 0  # split placement: devices given to rollout
    # rollout mesh tensor-parallel axis (its data axis takes the rest): a size, or auto: of
    # the widths the rollout devices and the model's KV heads allow (up to one 8-GPU host),
    # the narrowest within 10% of the one that leaves the most room for the KV pool
    rollout_tp: str = "auto"
    # logical axis -> mesh axes, for training; an axis missing here is replicated. The
    # expert axis splits experts (expert parallelism) and, like fsdp, batch rows and the
    # other weights (which mixture-of-experts layers have few of); the context axis splits
    # packed rows' tokens (never rows) and, like fsdp, the weights
    train_rules: dict[str, list[str]] = field(default_factory=lambda: {
        "batch": ["data", "fsdp", "expert"], "embed": ["fsdp", "context", "expert"],
        "vocab": ["tp"],
        "mlp": ["tp"], "heads": ["tp"], "kv_heads": ["tp"], "expert": ["expert"],
        "expert_mlp": ["tp"]})
    # logical axis -> rollout mesh axes (data, tp): parameters replicated over data
    sample_rules: dict[str, list[str]] = field(default_factory=lambda: {
        "batch": ["data"], "vocab": ["tp"], "mlp": ["tp"], "heads": ["tp"], "kv_heads": ["tp"],
        "expert": ["tp"]})

    def __post_init__(self) -> None:
        _tuplify(self)
        _choice("mesh.placement", self.placement, Placement)
        for key in ("data", "fsdp", "expert", "tp"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ConfigError(f"mesh.{key}={value} is not valid; use a positive size or -1 to fill.")
        width = self.context_width
        if width is not None and width != -1 and (width < 1 or width & (width - 1) or width > 32):
            raise ConfigError(f"mesh.context={self.context} is not valid; use auto, -1 to fill, "
                              f"or a power of two up to 32 (packed rows, 64 slots or more, "
                              f"split into 2 x mesh.context equal chunks).")
        filling = [f"mesh.{k}" for k, v in zip(("data", "fsdp", "context", "expert", "tp"),
                                               (self.data, self.fsdp, width, self.expert, self.tp))
                   if v == -1]
        if len(filling) > 1:  # mesh.data is -1 by default: the one the user did not set
            keep = next((k for k in filling if k != "mesh.data"), filling[0])
            raise ConfigError(f"{' and '.join(filling)} are {'both' if len(filling) == 2 else 'all'} "
                              f"-1 (fill the devices), and only one may be; set "
                              f"{' '.join(f'{k}=1' for k in filling if k != keep)} to let {keep} "
                              f"fill them, or give each a size.")
        if str(self.rollout_tp) != "auto" and not (str(self.rollout_tp).isdigit()
                                                   and int(self.rollout_tp) > 0):
            raise ConfigError(f"mesh.rollout_tp={self.rollout_tp} is not valid; use a positive "
                              f"size or auto.")
        for key, axes in (("train_rules", {"data", "fsdp", "context", "expert", "tp"}),
                          ("sample_rules", {"data", "tp"})):
            bad = {a for names in getattr(self, key).values() for a in names} - axes
            if bad:
                raise ConfigError(f"mesh.{key} names unknown mesh axes {sorted(bad)}; "
                                  f"use {', '.join(sorted(axes))}.")


    @property
    def context_width(self) -> int | None:
        """`context` as a size (-1: fill); None for auto (`gpurl.train.fitting.fitted`
        picks it from the memory plan)."""
        if str(self.context) == "auto":
            return None
        try:
            return int(self.context)
        except ValueError:
            raise ConfigError(f"mesh.context={self.context} is not valid; use auto, -1 to fill, "
                              f"or a power of two up to 32.") from None

    @property
    def rollout_width(self) -> int | None:
        """`rollout_tp` as a size; None for auto (the run picks it: `gpurl.distributed.layout`)."""
        return None if str(self.rollout_tp) == "auto" else int(self.rollout_tp)


@dataclass(frozen=True)
class LoggerConfig:
    name: str = "console"  # console (progress bar + metrics.jsonl), wandb (adds Weights & Biases) or tensorboard (adds event files in run.dir/tensorboard/)
    project: str = "gpurl"  # wandb project
    entity: Optional[str] = None  # wandb entity (team or user); null = your default
    mode: str = "auto"  # wandb mode: auto (online when WANDB_API_KEY is set, else offline), online, offline
    progress: bool = True  # show a progress bar on the console
    group: Optional[str] = None  # wandb group; null = the sweep directory's name under `gpurl train -m`, else none
    tags: list[str] = field(default_factory=list)  # wandb tags, e.g. [baseline,gemma]

    def __post_init__(self) -> None:
        _tuplify(self)
        _choice("logger.name", self.name, LoggerName)
        _choice("logger.mode", self.mode, ("auto", "online", "offline"))


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # output directory shared by all processes; holding a checkpoint means resume
    name: Optional[str] = None  # display name (wandb); null = the last part of run.dir


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: Optional[str] = None  # host:port of process 0; null = detect (Slurm) or single process
    num_processes: Optional[int] = None  # processes in the job; null = detect
    process_id: Optional[int] = None  # this process's index; null = detect
    init_timeout_s: int = 300  # give up (with an error) when the coordinator is unreachable this long
    heartbeat_timeout_s: int = 30  # a process silent this long is dead: the others stop (no hang)
    shutdown_timeout_s: int = 60  # how long a finishing process waits for the others at exit

    def __post_init__(self) -> None:
        for key in ("init_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            _positive(f"distributed.{key}", getattr(self, key))



@dataclass(frozen=True)
class RewardsConfig:
    """Reward functions: the reward of RL runs, and the answer check of every task
    evaluation (RL held-out figures, `gpurl eval`, a preference run's task accuracy)."""

    # built-in names or "pkg.module:function"; [] = the data's default (arithmetic:
    # first_number_match, countdown: countdown, gsm8k and math: math_verify, jsonl and hf:
    # numeric_match; gpurl/data/sources.py TASK_REWARDS lists them all). A
    # completion counts as correct in evaluations when the FIRST function gives it >= 1.
    # `rewards=[...]` on the command line is short for `rewards.functions=[...]`.
    functions: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one weight per function; [] = all 1
    # a function that raises, returns the wrong number of scores or times out: stop (end
    # the run naming it and the row) or zero (score those rows 0, counted in reward/errors)
    on_error: str = "stop"
    # seconds one call of a function (one shard's rows) may take before it counts as
    # failed; 0 = no limit. A timed-out call's thread cannot be killed and runs on unobserved.
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _tuplify(self)
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(f"{len(self.functions)} rewards but {len(self.weights)} "
                              f"reward_weights; give one weight per reward function "
                              f"(rewards.weights).")
        _choice("rewards.on_error", self.on_error, ("stop", "zero"))
        _positive("rewards.timeout_s", self.timeout_s, allow_zero=True)


@dataclass(frozen=True)
class PlanConfig:
    """The memory plan: every program of a run compiled ahead of time, nothing allocated
    (`gpurl plan` prints it; `gpurl train` checks it before it allocates anything)."""

    devices: int = 0  # gpurl plan: simulate this many CPU devices (8 = an 8-GPU node), or with plan.target that many GPUs; 0 = the devices there are (plan.target: 1)
    target: str = ""  # gpurl plan: compile for this GPU without one (h100, h200, a100, v100; needs the gpu-plan extra); "" = this machine's compiler
    device_memory_gb: float = 0.0  # memory of one device in GiB; 0 = the device's own (CPU: host RAM / local devices; simulated: 80; plan.target: its memory x XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)
    check: bool = True  # gpurl train stops with one sentence when a program does not fit
    prompt_len: int = 0  # gpurl plan, RL: plan for prompts of this many tokens; 0 = the data's longest
    json: str = ""  # gpurl plan: also write the plan to this JSON file (each program's memory; with plan.target the compiler's account of each program and the RL step's bound by phase)

    def __post_init__(self) -> None:
        _positive("plan.devices", self.devices, allow_zero=True)
        _positive("plan.device_memory_gb", self.device_memory_gb, allow_zero=True)
        _positive("plan.prompt_len", self.prompt_len, allow_zero=True)


@dataclass(frozen=True)
class Config:
    algo: AlgoConfig = field(default_factory=SFTConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn environments and tools (env=calculator); off by default


@dataclass(frozen=True)
class GenerateConfig:
    """`gpurl generate`: sample completions from a preset, a checkpoint or a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    prompt: Optional[str] = None  # one prompt
    prompts_file: Optional[str] = None  # jsonl rows with "prompt" (or "messages"; optional "max_new_tokens", "temperature", "seed"), or plain text lines
    n: int = 1  # completions per prompt
    seed: int = 0  # sampling seed (row i of prompt j uses seed + j * n + i)
    checkpoint: Optional[str] = None  # a gpurl run directory: its newest checkpoint and model config
    chat_template: bool = False  # wrap each prompt in the tokenizer's chat template
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn: step an environment between turns (env=calculator) and print each trajectory
    # with an environment and no prompt: the prompts (and their metadata, e.g. answer) are
    # the first `num_prompts` held-out rows of this data
    data: DataConfig = field(default_factory=DataConfig)
    num_prompts: int = 2  # held-out data rows shown with an environment when no prompt is given
    # with an environment: also write every trajectory to this jsonl file as an SFT row
    # {"prompt", "trajectory": [{"text", "train"}], "reward", ...metadata} (`algo=sft
    # data=jsonl data.path=...` trains on its model turns only); with several processes
    # each writes its own rows to <name>-<process>.jsonl
    record: Optional[str] = None

    def __post_init__(self) -> None:
        _positive("n", self.n)
        _positive("num_prompts", self.num_prompts)
        if self.prompt is not None and self.prompts_file is not None:
            raise ConfigError('give exactly one of prompt="..." or prompts_file=path.jsonl.')
        if self.prompt is None and self.prompts_file is None and not self.env.on:
            raise ConfigError('give exactly one of prompt="..." or prompts_file=path.jsonl '
                              '(or an environment, env=calculator, to use its data).')


@dataclass(frozen=True)
class ServeConfig:
    """`gpurl serve`: an OpenAI-compatible HTTP server on the rollout engine (docs/agents.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling defaults of a call that names none; rollout.max_new_tokens is a call's default limit
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: Optional[str] = None  # a gpurl run directory: its newest checkpoint and model config
    host: str = "127.0.0.1"  # the address to listen on; loopback by default (another address is reachable from the network: keep the key secret)
    port: int = 8000  # the port (0: a free one, printed)
    api_key: Optional[str] = None  # the key every request must carry (Authorization: Bearer KEY); null: $GPURL_API_KEY, else a random one printed at start
    served_model_name: Optional[str] = None  # the model id /v1/models lists; null: the model preset's name
    tool_format: str = "hermes"  # how the model writes tool calls, parsed into tool_calls (gpurl.envs.formats: hermes, llama3)
    max_context: int = 0  # prompt + completion tokens of a call at most; 0 = model.max_seq_len
    seed: int = 0  # random-init weights' seed (a preset without weights)

    def __post_init__(self) -> None:
        _positive("port", self.port, allow_zero=True)
        _positive("max_context", self.max_context, allow_zero=True)
        _choice("tool_format", self.tool_format, ("hermes", "llama3"))
        if self.port > 65535:
            raise ConfigError(f"port={self.port} is no TCP port; use 1-65535 (0: a free one).")


@dataclass(frozen=True)
class EvalConfig:
    """`gpurl eval`: held-out greedy accuracy and pass@k of a preset, checkpoint or run, or
    with `suite` its avg@n and pass@k on standard suites (docs/evaluation.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)  # as in train; the first function decides correctness
    env: EnvConfig = field(default_factory=EnvConfig)  # as in train: multi-turn trajectories, correct when the environment's reward is >= 1
    checkpoint: Optional[str] = None  # a gpurl run directory: its newest checkpoint and model config
    pass_k: int = 4  # samples per prompt for pass@k at rollout.temperature; 0 = greedy only
    batch_size: int = 128  # rows (prompts x samples) per generation call
    seed: int = 0  # sampling seed
    out: Optional[str] = None  # also write the figures to this json file; with suite: the directory of the results table (.md and .json)
    # standard suites instead of the data's held-out prompts: gsm8k, math500, aime2024,
    # aime2025, gpqa_diamond (docs/evaluation.md); `suite=math500` or `suite=[gsm8k,math500]`
    suite: list[str] = field(default_factory=list)
    suite_path: Optional[str] = None  # a local copy of the one suite's published split (jsonl, parquet, csv, ...); null = its Hub dataset
    num_samples: int = 1  # suites: samples per problem at rollout.temperature (the n of avg@n; pass@k for k = 1, 2, 4, ... and n)
    limit: int = 0  # suites: only the first N problems of each (smoke runs); 0 = all

    def __post_init__(self) -> None:
        _tuplify(self)
        _positive("pass_k", self.pass_k, allow_zero=True)
        _positive("batch_size", self.batch_size)
        _positive("num_samples", self.num_samples)
        _positive("limit", self.limit, allow_zero=True)
        if self.suite_path is not None and len(self.suite) != 1:
            raise ConfigError(f"suite_path={self.suite_path} is one suite's rows but suite="
                              f"{list(self.suite)}; name exactly one suite with it.")
