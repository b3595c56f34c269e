"""Typed schemas of every config group, and the choice enums their fields take.

Hydra composes YAML files in `configs/` over these schemas (registered in its
ConfigStore by `gpurl.cli`), so a typo in a key or a value of the wrong type fails at
composition. `gpurl.cli` converts the composed config once into these frozen
dataclasses; nothing below the CLI sees omegaconf. Every field carries a comment: it
is the documentation of the key (`gpurl train --cfg job` prints the values).

The `algo` group has one schema per family of algorithms (`gpurl.config_algo`, re-exported
here); each option in `configs/algo/` names the schema it fills, and
`gpurl.algorithms.registry` maps an algorithm's name to its schema. This module imports
only `gpurl.config_checks` (the value checks and `ConfigError`) and `gpurl.config_algo`,
`gpurl.config_env` and `gpurl.config_data` (the `algo`, `env` and `data` groups' schemas,
leaves like this one): every other module may import it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from gpurl.config_checks import DTYPES, ConfigError, lookup
from gpurl.config_checks import choice as _choice, enum_field as _enum, positive as _positive
from gpurl.config_checks import tuplify as _tuplify
from gpurl.config_algo import (Advantage, AlgoConfig, CriticBackbone, CriticConfig, Divergence,
                               DistillSignal, DPOConfig, DPOLoss, GRPOConfig, ImportanceRatio,
                               KDConfig, KLControlConfig, KLEstimator, LossAgg, OPDConfig,
                               ORPOConfig, PolicyGradientConfig, PPOConfig, RewardModelConfig,
                               SFTConfig, SimPOConfig, TeacherConfig)
from gpurl.config_data import DataConfig
from gpurl.config_env import EnvConfig

# re-exported: imported from here
__all__ = ["DTYPES", "ConfigError", "DataConfig", "EnvConfig", "lookup", "Advantage",
           "AlgoConfig", "CriticBackbone", "CriticConfig", "Divergence", "DistillSignal",
           "DPOConfig", "DPOLoss", "GRPOConfig", "ImportanceRatio", "KDConfig",
           "KLControlConfig", "KLEstimator", "LossAgg", "OPDConfig", "ORPOConfig",
           "PolicyGradientConfig", "PPOConfig", "RewardModelConfig", "SFTConfig", "SimPOConfig",
           "TeacherConfig"]


# ---------------------------------------------------------------- choice enums


class LoggerName(str, enum.Enum):
    CONSOLE = "console"
    WANDB = "wandb"
    TENSORBOARD = "tensorboard"


class Placement(str, enum.Enum):
    COLOCATED = "colocated"
    SPLIT = "split"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al. 2021): low-rank adapters on chosen projections train; the base is frozen."""

    rank: int = 0  # adapter rank r; 0 = LoRA off (full fine-tuning)
    alpha: float = 16.0  # adapters are scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on each adapter's input in training steps (PEFT's lora_dropout)
    # projections to adapt: globs (fnmatch, whole path) or regexes (re.search) over paths like
    # "blocks/3/attn/q" or "blocks/0/mlp/down" (attn q, k, v, o; mlp gate, up, down); ["*"] = all
    targets: list[str] = field(default_factory=lambda: ["*"])

    def __post_init__(self) -> None:
        _tuplify(self)
        _positive("model.lora.rank", self.rank, allow_zero=True)
        _positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout} is not valid; set it in [0, 1).")
        if self.rank and not self.targets:
            raise ConfigError("model.lora.targets is empty; name the projections to adapt, "
                              "e.g. model.lora.targets='[*]' for all of them.")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (Qwen3-MoE): a router picks `experts_per_token` of
    `num_experts` SwiGLU experts for every token; 0 experts = a dense model."""

    num_experts: int = 0  # experts of a sparse layer (HF num_experts); 0 = dense MLPs only
    experts_per_token: int = 2  # experts each token is routed to, top-k (HF num_experts_per_tok)
    expert_mlp_dim: int = 64  # hidden width of one expert (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum to 1
    sparse_step: int = 1  # layer i is sparse iff (i + 1) % sparse_step == 0 (HF decoder_sparse_step)
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP of model.mlp_dim (HF mlp_only_layers)
    # load-balancing loss (Switch Transformer eq. 4-6, as transformers' load_balancing_loss_func);
    # null = 0.001 (Qwen3's router_aux_loss_coef) for sft and rm, 0 for RL and preference
    # algorithms (verl's Megatron bridge turns load balancing off for RL)
    aux_loss_coef: Optional[float] = None
    z_loss_coef: float = 0.0  # router z-loss, mean logsumexp(router logits)^2 (ST-MoE, Zoph et al. 2022: 0.001)
    # the train step routes completion tokens to the experts the sampler chose for them
    # (so it scores the policy that sampled); prompt tokens route as usual
    replay_routing: bool = False
    # training's expert parallelism: a device runs at most this many times its even share of
    # its expert group's token copies and drops the rest, its highest experts' first (GShard /
    # Switch Transformer capacity; dropped copies add nothing, logged as moe/dropped);
    # 0 = never drop (buffers for every copy); sampling never drops
    capacity_factor: float = 0.0
    # the experts' grouped matmul: auto (tiled), tiled (jnp: tokens sorted by expert in
    # fixed-size tiles, one expert per tile), ragged (jax.lax.ragged_dot, which XLA expands
    # into a matmul of every token with every expert, on GPU too: E x the flops)
    grouped_matmul: str = "auto"

    def __post_init__(self) -> None:
        _tuplify(self)
        _positive("model.moe.num_experts", self.num_experts, allow_zero=True)
        for key in ("experts_per_token", "expert_mlp_dim", "sparse_step"):
            _positive(f"model.moe.{key}", getattr(self, key))
        _positive("model.moe.z_loss_coef", self.z_loss_coef, allow_zero=True)
        _positive("model.moe.capacity_factor", self.capacity_factor, allow_zero=True)
        if self.aux_loss_coef is not None:
            _positive("model.moe.aux_loss_coef", self.aux_loss_coef, allow_zero=True)
        _choice("model.moe.grouped_matmul", self.grouped_matmul, ("auto", "ragged", "tiled"))
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ConfigError(f"model.moe.experts_per_token={self.experts_per_token} exceeds "
                              f"model.moe.num_experts={self.num_experts}; route each token to "
                              f"at most num_experts experts.")

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.sparse_step == 0)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder; families differ only by these fields (presets in configs/model/)."""

    name: str = "tiny"  # preset name (see configs/model/)
    family: str = "gemma"  # architecture family (a file of gpurl/models/families/): gemma, gemma2, gemma3, llama, qwen2, qwen3, qwen3_moe
    checkpoint: Optional[str] = None  # HF safetensors dir or .gguf file; null = the preset's packaged weights (gemma3_270m: the GGUF package), else random where model.init allows
    vocab_size: int = 512  # rows of the embedding (>= the tokenizer's vocabulary)
    d_model: int = 64  # residual width D
    num_layers: int = 2  # decoder blocks L
    num_heads: int = 4  # query heads H
    num_kv_heads: int = 2  # key/value heads K (H % K == 0; K < H is GQA, K = 1 is MQA)
    head_dim: int = 16  # width of one head
    mlp_dim: int = 128  # hidden width of the gated MLP
    activation: str = "gelu_tanh"  # gate activation: gelu_tanh (GeGLU) or silu (SwiGLU)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    norm_plus_one: bool = True  # RMSNorm scales by (1 + w) with w initialized at 0 (Gemma); else by w
    post_norms: bool = False  # extra RMSNorm after attention and after the MLP (Gemma 2/3)
    qk_norm: bool = False  # RMSNorm over each query and key head (Gemma 3, Qwen 3)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen 2.5)
    tie_embeddings: bool = True  # output projection shares the embedding matrix
    scale_embeddings: bool = True  # multiply embeddings by sqrt(D) (Gemma)
    query_pre_attn_scalar: Optional[float] = None  # attention scale is this ** -0.5; null = head_dim
    attn_softcap: Optional[float] = None  # cap * tanh(logits / cap) on attention logits (Gemma 2)
    final_softcap: Optional[float] = None  # the same on output logits (Gemma 2)
    sliding_window: Optional[int] = None  # local layers attend to this many tokens; null = all global
    global_every: int = 1  # layer i is global iff (i + 1) % global_every == 0 (Gemma 2: 2, Gemma 3: 6)
    rope_theta: float = 10000.0  # RoPE base (global layers)
    rope_local_theta: Optional[float] = None  # RoPE base of sliding-window layers; null = rope_theta
    rope_scaling: str = "none"  # RoPE scaling of global layers: none, linear (Gemma 3 4B+), llama3
    rope_scaling_factor: float = 1.0  # linear/llama3: context extension factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low-frequency factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high-frequency factor
    rope_original_max_len: int = 8192  # llama3 scaling: original pre-training context length
    max_seq_len: int = 2048  # longest sequence the model is used with
    dtype: str = "auto"  # compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16
    param_dtype: str = "float32"  # dtype of stored parameters and optimizer moments
    attention: str = "auto"  # attention kernel: auto (cudnn, else pallas, on GPU; xla on CPU), xla, cudnn, pallas
    init_std: float = 0.02  # std of the random normal init of projections
    # where the weights come from: checkpoint (model.checkpoint, or the preset's packaged
    # weights; without either the run stops: the real-model presets), random (drawn from
    # train.seed: tests, benchmarks), or auto (a checkpoint when there is one, else random)
    init: str = "auto"
    # what the backward pass keeps of each layer (the rest is recomputed): auto (full on
    # accelerators, none on CPU), none, full (only the layer's input), dots (matmul outputs
    # too), qkv (the q, k, v projections too)
    remat: str = "auto"
    # how the rollout's programs (prefill, decode) run the layers: auto (unrolled on GPU,
    # scan on CPU), unrolled (the rollout's copy holds each layer's weights as arrays of
    # their own, read in place: XLA's GPU programs copy a stacked layer's weights out before
    # each matmul, 3x a decode step's weight traffic; longer compiles), scan (one layer
    # compiled, run over the stack)
    sampling_layers: str = "auto"
    tokenizer: str = "auto"  # auto (the checkpoint's, else bytes), bytes (built-in byte-level), or a tokenizer.json path
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (model.lora.rank > 0 turns them on)
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts MLPs (model.moe.num_experts > 0 turns them on)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "mlp_dim", "max_seq_len", "global_every"):
            _positive(f"model.{key}", getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}; choose num_kv_heads dividing num_heads.")
        _choice("model.activation", self.activation, ("gelu_tanh", "silu"))
        _choice("model.rope_scaling", self.rope_scaling, ("none", "linear", "llama3"))
        _choice("model.dtype", self.dtype, ("auto",) + DTYPES)
        _choice("model.param_dtype", self.param_dtype, DTYPES)
        _choice("model.attention", self.attention, ("auto", "xla", "cudnn", "pallas"))
        _choice("model.init", self.init, ("auto", "checkpoint", "random"))
        _choice("model.remat", self.remat, ("auto", "none", "full", "dots", "qkv"))
        _choice("model.sampling_layers", self.sampling_layers, ("auto", "unrolled", "scan"))
        bad = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model.moe.dense_layers names layers {bad} outside 0..{self.num_layers - 1}; "
                              f"list layers of the model.")
        if self.moe.num_experts and self.lora.rank and not all(
                self.moe.is_sparse(i) for i in range(self.num_layers)):
            raise ConfigError("LoRA on a mixture-of-experts model with dense layers "
                              "(model.moe.dense_layers or sparse_step > 1) is not supported; use "
                              "full fine-tuning or a model whose layers are all sparse.")
        if self.init == "random" and self.checkpoint is not None:
            raise ConfigError(f"model.init=random draws random weights but model.checkpoint="
                              f"{self.checkpoint} is set; drop one of the two.")

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to the whole context (else to `sliding_window` tokens)."""
        return self.sliding_window is None or (layer + 1) % self.global_every == 0


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
    eval_batch_size: int = 64  # rows per eval forward pass
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the end); 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    log_every: int = 1  # write metrics every N steps
    eval_pass_k: int = 4  # RL eval: samples per held-out prompt for pass@k (rollout temperature); 0 = greedy only
    # a NaN or infinite loss or gradient norm: stop (end the run naming the step; the last
    # checkpoint stays the newest) or skip (leave that update out, count it in nonfinite_skipped)
    on_nonfinite: str = "stop"
    # RL and preference pairs: every pass of the step (reference, old policy, critic, reward
    # model, policy) runs on packed rows: completions end to end, each group's prompt once
    # per row, no padding slots beyond bucket rounding; false = the padded P x G x N layout
    packed: bool = True
    # packed: tokens per micro-batch on each batch shard (rows of the batch's row length
    # that fit; at least one row); 0 = as many as one padded micro-batch holds
    # (micro_batch_size x G x (prompt width + completion width) / batch shards; pairs: G = 2)
    micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        _choice("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        for key in ("steps", "batch_size", "eval_batch_size", "keep_checkpoints", "log_every"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("micro_batch_size", "eval_every", "checkpoint_every", "eval_pass_k",
                    "micro_batch_tokens"):
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
    slots: int = 64  # requests decoding at once per rollout data shard; the rest wait in a queue
    block_size: int = 64  # tokens per block of the paged KV cache
    kv_cache_tokens: int = 0  # KV cache cap per data shard, in tokens; 0 = the requests' worst case
    decode_chunk: int = 16  # decode steps per device call between two scheduling rounds
    # `async` is a Python keyword: the YAML key is `async`, the field `async_`.
    async_: bool = False  # overlap the next rollout with training (split placement)

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


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # trainer data-parallel axis; -1 = all devices left over
    fsdp: int = 1  # trainer fully-sharded axis (parameters and optimizer state sharded)
    tp: int = 1  # trainer tensor-parallel axis
    expert: int = 1  # trainer expert-parallel axis: a mixture-of-experts model's experts are split over it (batch rows too)
    placement: str = "colocated"  # colocated (rollout and trainer share devices) or split
    rollout_devices: int = 0  # split placement: devices given to rollout
    # rollout mesh tensor-parallel axis (its data axis takes the rest): a size, or auto: of
    # the widths the rollout devices and the model's KV heads allow (up to one 8-GPU host),
    # the narrowest within 10% of the one that leaves the most room for the KV pool
    rollout_tp: str = "auto"
    # logical axis -> mesh axes, for training; an axis missing here is replicated. The
    # expert axis splits experts (expert parallelism) and, like fsdp, batch rows and the
    # other weights (which mixture-of-experts layers have few of)
    train_rules: dict[str, list[str]] = field(default_factory=lambda: {
        "batch": ["data", "fsdp", "expert"], "embed": ["fsdp", "expert"], "vocab": ["tp"],
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
        if [self.data, self.fsdp, self.expert, self.tp].count(-1) > 1:
            raise ConfigError("Only one of mesh.data, mesh.fsdp, mesh.expert, mesh.tp may be -1; "
                              "set the others.")
        if str(self.rollout_tp) != "auto" and not (str(self.rollout_tp).isdigit()
                                                   and int(self.rollout_tp) > 0):
            raise ConfigError(f"mesh.rollout_tp={self.rollout_tp} is not valid; use a positive "
                              f"size or auto.")
        for key, axes in (("train_rules", {"data", "fsdp", "expert", "tp"}), ("sample_rules", {"data", "tp"})):
            bad = {a for names in getattr(self, key).values() for a in names} - axes
            if bad:
                raise ConfigError(f"mesh.{key} names unknown mesh axes {sorted(bad)}; "
                                  f"use {', '.join(sorted(axes))}.")


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
    # first_number_match, countdown: countdown, gsm8k and jsonl: numeric_match). A
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
class EvalConfig:
    """`gpurl eval`: held-out greedy accuracy and pass@k of a preset, checkpoint or run."""

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
    out: Optional[str] = None  # also write the figures to this json file

    def __post_init__(self) -> None:
        _positive("pass_k", self.pass_k, allow_zero=True)
        _positive("batch_size", self.batch_size)
