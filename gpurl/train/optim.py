"""AdamW with linear warm-up, cosine (or constant) decay and global-norm clipping."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import optax

from gpurl.config import ModelConfig, OptimConfig
from gpurl.models import lora
from gpurl.models.paths import model_path


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `lr`, then cosine to `min_lr_ratio * lr` at `total_steps`
    (Loshchilov & Hutter 2017, SGDR, eq. 5, one cycle without restarts)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if cfg.decay == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)), optax.constant_schedule(cfg.lr)],
            [warmup]) if warmup else optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
    """Decoupled weight decay on matrices only: norms and biases are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def trainable(params: Any, freeze: Sequence[str]) -> Any:
    """Tree of bools: False for parameters whose path matches an `optim.freeze` regex."""
    patterns = [re.compile(p) for p in freeze]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p.search(model_path(path)) for p in patterns), params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) after clipping (Pascanu et al. 2013).
    Frozen parameters (`optim.freeze`) get no update and no optimizer state."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.max_grad_norm > 0:
        adamw = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    if not cfg.freeze:
        return adamw

    def labels(params):
        return jax.tree.map(lambda t: "train" if t else "frozen", trainable(params, cfg.freeze))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


# The vision tower and projector of a vision-language model (`model.vision`).
VISION_PATTERN = "^vision/"


def frozen_patterns(cfg: OptimConfig, model: ModelConfig) -> tuple[str, ...]:
    """`optim.freeze` with what the model config freezes too: a vision-language model's
    tower unless model.vision.trainable."""
    extra = (VISION_PATTERN,) if model.vision.layers and not model.vision.trainable else ()
    return tuple(cfg.freeze) + extra


def train_optimizer(cfg: OptimConfig, model: ModelConfig, parts: dict[str, float | None] | None,
                    total_steps: int) -> optax.GradientTransformation:
    """The optimizer of a run. `parts` (an algorithm's record: PPO's {"policy", "critic"})
    gives each top-level part of the trained tree an AdamW of its own, at its learning
    rate (None: optim.lr) on the same schedule, clipped by its own gradient norm. With LoRA
    the base is frozen: only the adapters (and heads) have Adam moments."""
    cfg = lora.optim_config(dataclasses.replace(cfg, freeze=frozen_patterns(cfg, model)), model)
    if parts is None:
        return make_optimizer(cfg, total_steps)
    return optax.multi_transform(
        {name: make_optimizer(dataclasses.replace(cfg, lr=lr or cfg.lr), total_steps)
         for name, lr in parts.items()}, {name: name for name in parts})
