"""Supervised fine-tuning: next-token cross-entropy on completion tokens only.

The loss is a token mean over the whole global batch (normalizer: completion tokens in
the batch), so gradient accumulation over micro-batches gives the same update as one
large batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpurl.algorithms.forward import head_chunk, head_params, row_head, row_hidden, shifted_targets
from gpurl.algorithms.objective import Batch, Objective
from gpurl.config import RolloutConfig, SFTConfig
from gpurl.kernels.logprob import chunked_head


def token_nll(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
              label_smoothing: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token (fp32): the cross-entropy the loss trains on (label-smoothed when
    `label_smoothing` > 0), the target's negative log-likelihood (never smoothed: what a
    perplexity reports), and whether the argmax is the target."""
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    ce_BxT = nll_BxT
    if label_smoothing:
        # Szegedy et al. 2016, sec. 7: mix the one-hot target with the uniform distribution.
        ce_BxT = (1 - label_smoothing) * nll_BxT - label_smoothing * logp_BxTxV.mean(-1)
    correct_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
    return ce_BxT, nll_BxT, correct_BxT


def objective(cfg: SFTConfig, rollout: RolloutConfig) -> Objective:
    def normalizer(batch: Batch) -> jax.Array:
        return jnp.maximum(shifted_targets(batch)[1].sum(), 1.0)

    def stats(logits_BxCxV: jax.Array, targets_BxC: jax.Array) -> tuple[jax.Array, ...]:
        ce_BxC, nll_BxC, correct_BxC = token_nll(logits_BxCxV, targets_BxC, cfg.label_smoothing)
        return ce_BxC, nll_BxC, correct_BxC.astype(jnp.float32)

    def loss(spec, params: Any, batch: Batch, norm: jax.Array):
        head_BxTxD, targets_BxT, mask_BxT = row_head(row_hidden(spec, params, batch), batch)
        # The head runs chunk by chunk: B x T x V logits never exist (`chunked_head`).
        ce_BxT, nll_BxT, correct_BxT = chunked_head(spec.logits, head_params(spec, params),
                                                    head_BxTxD, targets_BxT, stats, head_chunk(spec))
        loss_sum = (ce_BxT * mask_BxT).sum()
        metrics = {"loss": loss_sum / norm, "nll": (nll_BxT * mask_BxT).sum() / norm,
                   "token_accuracy": (correct_BxT * mask_BxT).sum() / norm,
                   "tokens": mask_BxT.sum()}
        return loss_sum / norm, metrics

    return Objective(loss=loss, normalizer=normalizer)
