"""AdamW with linear warm-up, cosine (or constant) decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from gpurl.config import OptimConfig


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


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) after clipping (Pascanu et al. 2013)."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw
