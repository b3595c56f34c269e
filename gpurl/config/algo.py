"""The `algo` group's schemas, one per family of algorithms (SFT and logit distillation,
policy gradient: the GRPO family, on-policy distillation and PPO, preference
optimization), and the choice enums their fields take. Each option in `configs/algo/`
names the schema it fills; `gpurl.algorithms.registry` maps an algorithm's name to its
schema. It imports only `gpurl.config.checks`; `gpurl.config` re-exports every name here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Optional

from gpurl.config.checks import DTYPES, ConfigError
from gpurl.config.checks import choice as _choice, enum_field as _enum, positive as _positive


# ---------------------------------------------------------------- choice enums
# Values of string-valued keys. The algorithms' enums key registries of pure functions
# (gpurl/algorithms/policy_gradient.py, dpo.py): one function per member, tested.


class KLEstimator(str, enum.Enum):
    """Per-token estimators of KL(pi || pi_ref) (Schulman 2020)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LossAgg(str, enum.Enum):
    """How per-token losses become one number (each names its normalizer)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class Advantage(str, enum.Enum):
    """Advantage estimators over the G completions of a prompt."""

    GRPO = "grpo"
    DRGRPO = "drgrpo"
    RLOO = "rloo"


class TISLevel(str, enum.Enum):
    """Where the behaviour ratio pi_old / pi_behaviour is read, for the truncated weight
    (`algo.tis_level`) and the ratio mask (`algo.ratio_mask`): per token, per sequence
    (the product over its tokens, one value for all of them), or the sequence's geometric
    mean (exp of the mean log-ratio over its tokens)."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


RATIO_MASK_OFF = "off"  # algo.ratio_mask: no mask (the other values are TISLevel's)


class ImportanceRatio(str, enum.Enum):
    """The policy ratio the clipped surrogate uses: per token, or GSPO's per sequence."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    SEQUENCE_TOKEN = "sequence_token"


class Divergence(str, enum.Enum):
    """Per-token divergences between the student's and the teacher's next-token
    distributions (`gpurl/algorithms/distill.py`)."""

    FORWARD_KL = "forward_kl"
    REVERSE_KL = "reverse_kl"
    JSD = "jsd"


class DistillSignal(str, enum.Enum):
    """What on-policy distillation trains on at each sampled position."""

    SAMPLED = "sampled"  # log p_teacher - log p_student of the sampled token, as its advantage
    FULL = "full"  # the exact reverse KL over the vocabulary (or the student's top-k), as a loss


class DPOLoss(str, enum.Enum):
    """DPO's loss on the reference-normalized log-ratio margin."""

    SIGMOID = "sigmoid"
    IPO = "ipo"
    HINGE = "hinge"


class CriticBackbone(str, enum.Enum):
    """Where PPO's value head reads its states."""

    SEPARATE = "separate"
    SHARED = "shared"


# ---------------------------------------------------------------- algo: one schema per family


@dataclass(frozen=True)
class AlgoConfig:
    """The objective. Each option of configs/algo/ fills one of the schemas below (the
    first line of its defaults list names it) with the published values of its paper."""

    # registered algorithm (gpurl/algorithms/registry.py): sft, kd, grpo, gspo, dapo, drgrpo,
    # rloo, ppo, opd, dpo, simpo, orpo, rm
    name: str = "sft"
    schema: ClassVar[str] = "algo"  # ConfigStore name of the schema: gpurl_<schema>


@dataclass(frozen=True)
class SFTConfig(AlgoConfig):
    """Supervised fine-tuning (`algo=sft`)."""

    schema: ClassVar[str] = "algo_sft"
    label_smoothing: float = 0.0  # cross-entropy label smoothing in [0, 1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(
                f"algo.label_smoothing={self.label_smoothing} is not valid; use a value in [0, 1).")


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of a distillation algorithm (`algo=opd`, `algo=kd`): loaded like
    model.checkpoint (its own config.json or GGUF metadata sets its architecture), sharded
    on the trainer mesh by the same rules as the student, never trained, checkpointed or
    sent to the rollout devices. It must share the student's tokenizer."""

    teacher: Optional[str] = None  # HF safetensors dir or .gguf file of the teacher (required); may be larger than the student
    teacher_dtype: str = "auto"  # the teacher's stored and compute dtype: auto (the student's compute dtype), float32, bfloat16, float16

    def _check_teacher(self) -> None:
        _choice("algo.teacher_dtype", self.teacher_dtype, ("auto",) + DTYPES)


@dataclass(frozen=True)
class KDConfig(TeacherConfig, SFTConfig):
    """Logit distillation on a dataset (`algo=kd`): at every target token of the SFT data,
    a divergence between the student's and the teacher's next-token distributions, mixed
    with the cross-entropy on the data's tokens."""

    schema: ClassVar[str] = "algo_kd"
    name: str = "kd"
    divergence: str = "forward_kl"  # forward_kl (KL(teacher || student), Hinton 2015), reverse_kl (KL(student || teacher)) or jsd (GKD's generalized Jensen-Shannon, algo.jsd_beta)
    jsd_beta: float = 0.5  # divergence=jsd: the mixture weight beta in [0, 1] (0 = forward KL, 1 = reverse KL, Agarwal et al. 2024)
    ce_weight: float = 0.0  # loss = (1 - w) x divergence + w x cross-entropy on the data's tokens, w in [0, 1]
    kd_temperature: float = 1.0  # both distributions at softmax(logits / tau); the divergence is scaled by tau^2 (Hinton 2015)

    def __post_init__(self) -> None:
        SFTConfig.__post_init__(self)
        self._check_teacher()
        _enum(self, "divergence", "algo.divergence", Divergence)
        if not 0.0 <= self.jsd_beta <= 1.0 or not 0.0 <= self.ce_weight <= 1.0:
            raise ConfigError(f"algo.jsd_beta={self.jsd_beta} and algo.ce_weight={self.ce_weight} "
                              f"must lie in [0, 1].")
        _positive("algo.kd_temperature", self.kd_temperature)


@dataclass(frozen=True)
class PolicyGradientConfig(AlgoConfig):
    """What every RL algorithm shares: sampling G completions per prompt, the clipped
    surrogate with its importance ratio, the KL term, the loss aggregation, and reward
    shaping. `GRPOConfig` adds group advantages, `PPOConfig` a critic."""

    schema: ClassVar[str] = "algo_policy_gradient"
    name: str = "grpo"
    num_generations: int = 8  # completions G sampled per prompt
    beta: float = 0.0  # KL coefficient to the frozen reference (0 = no reference pass)
    kl_estimator: str = "k3"  # k1, k2 or k3 (Schulman 2020)
    kl_in_reward: bool = False  # subtract beta * KL from the reward instead of adding it to the loss
    epsilon: float = 0.2  # ratio clip: lower bound 1 - epsilon
    epsilon_high: Optional[float] = None  # clip-higher upper bound 1 + epsilon_high; null = epsilon
    dual_clip: Optional[float] = None  # bound the loss of negative advantages at -c*A (c > 1); null = off
    loss_agg: str = "seq_mean_token_mean"  # token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm
    importance: str = "token"  # token ratios (GRPO/PPO), sequence (GSPO) or sequence_token (GSPO-token)
    num_iterations: int = 1  # optimizer passes over each batch; > 1 uses the old log-probs
    # truncated importance sampling: cap C of min(pi_old / pi_sampler, C) per token, on any
    # run when set; null = off on synchronous runs and C = 2 on runs that train off-policy
    # tokens (rollout.mode=one_ahead with split placement, rollout.mode=continuous)
    tis_cap: Optional[float] = None
    # off-policy runs (rollout.mode=one_ahead with split placement, rollout.mode=continuous):
    # weight tokens sampled under older weights by min(pi_old / pi_sampler, C), C = tis_cap
    # or 2; false = none (unless tis_cap is set)
    async_correction: bool = True
    tis_level: str = "token"  # truncated importance weight per token, per sequence (the product of its tokens' ratios) or geometric (their geometric mean)
    # masked importance sampling: a token's weight is 0 where pi_old / pi_sampler, read per
    # token, sequence (product) or geometric (the sequence's geometric mean), leaves
    # [ratio_mask_low, ratio_mask_high]; off = no mask (IcePop: token, 0.5, 5 with tis_cap=5)
    ratio_mask: str = "off"
    ratio_mask_low: float = 0.5  # ratio_mask: the band's lower end (>= 0, <= 1)
    ratio_mask_high: float = 5.0  # ratio_mask: the band's upper end (>= 1)
    # mismatch/over_threshold: the share of trained tokens whose |log pi_old - log pi_sampler| exceeds this
    mismatch_threshold: float = 0.1
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill the batch
    max_refills: int = 4  # dynamic sampling: extra rollout rounds per step at most
    overlong_buffer: int = 0  # DAPO overlong shaping: penalty ramps over the last N tokens; 0 = off
    overlong_penalty: float = 1.0  # DAPO overlong shaping: penalty at the length limit
    # HF ...ForSequenceClassification dir (e.g. `gpurl export` of an rm run) whose score is
    # added to the reward on device; with no `rewards` named, the data's functions only report
    reward_model: Optional[str] = None

    def __post_init__(self) -> None:
        _enum(self, "kl_estimator", "algo.kl_estimator", KLEstimator)
        _enum(self, "loss_agg", "algo.loss_agg", LossAgg)
        _enum(self, "importance", "algo.importance", ImportanceRatio)
        _enum(self, "tis_level", "algo.tis_level", TISLevel)
        _choice("algo.ratio_mask", self.ratio_mask,
                (RATIO_MASK_OFF,) + tuple(m.value for m in TISLevel))
        if not 0.0 <= self.ratio_mask_low <= 1.0 <= self.ratio_mask_high:
            raise ConfigError(
                f"algo.ratio_mask_low={self.ratio_mask_low} and algo.ratio_mask_high="
                f"{self.ratio_mask_high} must bracket 1 (0 <= low <= 1 <= high), or every "
                f"on-policy token would be masked; use e.g. 0.5 and 5.")
        _positive("algo.mismatch_threshold", self.mismatch_threshold)
        _positive("algo.beta", self.beta, allow_zero=True)
        _positive("algo.epsilon", self.epsilon)
        if self.tis_cap is not None:
            _positive("algo.tis_cap", self.tis_cap)
        for key in ("num_iterations", "num_generations"):
            _positive(f"algo.{key}", getattr(self, key))
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algo.dual_clip={self.dual_clip} must exceed 1; use e.g. 3 or null.")
        if self.dynamic_sampling and self.reward_model is not None:
            raise ConfigError("algo.dynamic_sampling picks groups by the reward functions before "
                              "algo.reward_model scores them; set algo.dynamic_sampling=false "
                              "or drop algo.reward_model.")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class GRPOConfig(PolicyGradientConfig):
    """GRPO and its variants (`algo=grpo`, `gspo`, `dapo`, `drgrpo`, `rloo`): advantages
    from the rewards of each prompt's G completions."""

    schema: ClassVar[str] = "algo_grpo"
    advantage: str = "grpo"  # grpo (mean/std), drgrpo (mean only), rloo (leave-one-out)
    adv_eps: float = 1e-4  # added to the group std (grpo advantages)

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "advantage", "algo.advantage", Advantage)
        if self.num_generations < 2:
            raise ConfigError(f"algo.num_generations={self.num_generations} gives no group to "
                              f"compare; use at least 2.")


@dataclass(frozen=True)
class OPDConfig(TeacherConfig, GRPOConfig):
    """On-policy distillation (`algo=opd`): the student samples, the teacher scores every
    sampled token, and the per-token reverse KL to the teacher is the training signal,
    optionally beside the group advantages of the task rewards (`algo.task_weight`)."""

    schema: ClassVar[str] = "algo_opd"
    name: str = "opd"
    signal: str = "sampled"  # sampled (log p_teacher - log p_student of each sampled token, as its advantage) or full (the exact reverse KL over the vocabulary at each sampled position, as a loss)
    top_k: int = 0  # signal=full: sum the reverse KL over the student's top-k tokens only; 0 = the whole vocabulary
    task_weight: float = 0.0  # weight of the task rewards' group advantages added to the distillation signal; 0 = pure distillation (rewards only reported)
    distill_weight: float = 1.0  # weight of the distillation signal (the per-token advantage, or the full KL in the loss)

    def __post_init__(self) -> None:
        GRPOConfig.__post_init__(self)
        self._check_teacher()
        _enum(self, "signal", "algo.signal", DistillSignal)
        _positive("algo.top_k", self.top_k, allow_zero=True)
        _positive("algo.task_weight", self.task_weight, allow_zero=True)
        _positive("algo.distill_weight", self.distill_weight, allow_zero=True)
        if self.top_k and self.signal != DistillSignal.FULL:
            raise ConfigError(f"algo.top_k={self.top_k} restricts the full-vocabulary KL; set "
                              f"algo.signal=full or algo.top_k=0.")
        if self.beta > 0 and self.kl_in_reward:
            # the reward's group advantages are scaled by task_weight, the KL penalty with them
            raise ConfigError(f"algo=opd weighs the rewards' advantages by algo.task_weight="
                              f"{self.task_weight:g}, so a KL penalty in the reward would be "
                              f"weighed by it and not by algo.beta; set algo.kl_in_reward=false "
                              f"(the penalty in the loss) or algo.beta=0.")


@dataclass(frozen=True)
class CriticConfig:
    """PPO's critic: a value head, on its own backbone or on the policy's."""

    critic: str = "separate"  # separate (a value head on its own backbone) or shared (on the policy's backbone)
    critic_lr: Optional[float] = None  # learning rate of the critic (same schedule as the policy); null = optim.lr
    vf_coef: float = 0.5  # weight of the value loss in the total loss
    value_clip: Optional[float] = 0.2  # clip new values to old +- this (PPO2 value clipping); null = off

    def _check_critic(self) -> None:
        _enum(self, "critic", "algo.critic", CriticBackbone)
        _positive("algo.vf_coef", self.vf_coef, allow_zero=True)
        for key in ("critic_lr", "value_clip"):
            if getattr(self, key) is not None:
                _positive(f"algo.{key}", getattr(self, key))


@dataclass(frozen=True)
class KLControlConfig:
    """PPO's KL coefficient: fixed at algo.beta, or adapted to a target (Ziegler 2019)."""

    kl_target: Optional[float] = None  # adaptive KL coefficient aiming at this KL per sequence (Ziegler 2019); null = fixed beta
    kl_horizon: int = 10000  # adaptive KL: beta changes by at most 20% x rows / horizon per step

    def _check_kl_control(self, beta: float) -> None:
        _positive("algo.kl_horizon", self.kl_horizon)
        if self.kl_target is not None:
            _positive("algo.kl_target", self.kl_target)
            if beta <= 0:
                raise ConfigError(f"algo.kl_target={self.kl_target} adapts a KL coefficient that "
                                  f"starts at algo.beta=0; set algo.beta > 0 (e.g. 0.05).")


@dataclass(frozen=True)
class PPOConfig(CriticConfig, KLControlConfig, PolicyGradientConfig):
    """PPO with a learned critic (`algo=ppo`): GAE advantages per token, the KL penalty in
    the per-token reward, and the critic and KL-control parts above."""

    schema: ClassVar[str] = "algo_ppo"
    name: str = "ppo"
    gamma: float = 1.0  # discount of GAE (Schulman 2016)
    lam: float = 0.95  # GAE lambda (bias-variance trade-off of the advantage estimate)
    whiten_advantages: bool = True  # advantages to zero mean, unit variance over the batch's tokens
    entropy_coef: float = 0.0  # entropy bonus weight (the loss subtracts coef * mean token entropy)

    def __post_init__(self) -> None:
        PolicyGradientConfig.__post_init__(self)
        self._check_critic()
        self._check_kl_control(self.beta)
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"algo.gamma={self.gamma} and algo.lam={self.lam} must lie in [0, 1].")
        _positive("algo.entropy_coef", self.entropy_coef, allow_zero=True)
        if self.beta > 0 and not self.kl_in_reward:
            raise ConfigError("algo=ppo puts the KL penalty in the per-token reward; set "
                              "algo.kl_in_reward=true (or algo.beta=0 for no penalty).")


def _check_smoothing(eps: float, smoothed: bool, where: str) -> None:
    """Label smoothing of a preference loss: the share eps in [0, 0.5) of pairs assumed
    flipped (conservative DPO, Mitchell 2023), defined for the log-sigmoid losses only."""
    if eps and (not smoothed or not 0.0 < eps < 0.5):
        raise ConfigError(
            f"algo.label_smoothing={eps} is not valid for {where}; it needs "
            f"algo.dpo_loss=sigmoid or algo=simpo and a value in [0, 0.5).")


@dataclass(frozen=True)
class DPOConfig(AlgoConfig):
    """DPO and its loss variants (`algo=dpo`, `ipo`) on preference pairs, against the
    frozen initial model."""

    schema: ClassVar[str] = "algo_dpo"
    name: str = "dpo"
    beta: float = 0.1  # reward scale beta of the log-ratio margin
    dpo_loss: str = "sigmoid"  # sigmoid (Rafailov 2023), ipo (Azar 2023) or hinge (SLiC, Zhao 2023)
    label_smoothing: float = 0.0  # sigmoid loss: the share eps in [0, 0.5) of pairs assumed flipped (conservative DPO, Mitchell 2023)

    def __post_init__(self) -> None:
        _enum(self, "dpo_loss", "algo.dpo_loss", DPOLoss)
        _positive("algo.beta", self.beta)
        _check_smoothing(self.label_smoothing, self.dpo_loss == DPOLoss.SIGMOID,
                         f"algo={self.name} algo.dpo_loss={self.dpo_loss.value}")


@dataclass(frozen=True)
class SimPOConfig(AlgoConfig):
    """SimPO (`algo=simpo`): length-normalized rewards and a target margin, no reference."""

    schema: ClassVar[str] = "algo_simpo"
    name: str = "simpo"
    beta: float = 2.0  # reward scale of the length-normalized log-probs
    simpo_gamma: float = 0.5  # target reward margin gamma (Meng 2024)
    label_smoothing: float = 0.0  # the share eps in [0, 0.5) of pairs assumed flipped

    def __post_init__(self) -> None:
        _positive("algo.beta", self.beta)
        _positive("algo.simpo_gamma", self.simpo_gamma, allow_zero=True)
        _check_smoothing(self.label_smoothing, True, f"algo={self.name}")


@dataclass(frozen=True)
class ORPOConfig(AlgoConfig):
    """ORPO (`algo=orpo`): the chosen completion's NLL plus an odds-ratio term, no reference."""

    schema: ClassVar[str] = "algo_orpo"
    name: str = "orpo"
    orpo_lambda: float = 0.1  # weight lambda of the odds-ratio term beside the chosen NLL (Hong 2024)

    def __post_init__(self) -> None:
        _positive("algo.orpo_lambda", self.orpo_lambda, allow_zero=True)


@dataclass(frozen=True)
class RewardModelConfig(AlgoConfig):
    """A reward model trained with Bradley-Terry on preference pairs (`algo=rm`)."""

    schema: ClassVar[str] = "algo_rm"
    name: str = "rm"
