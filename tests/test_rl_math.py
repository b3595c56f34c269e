"""Shared RL math against NumPy transcriptions of the papers' equations, on random
inputs with masks (DeepSeekMath GRPO, Dr. GRPO, DAPO, RLOO, GSPO, Schulman's KL estimators)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import algo_config
from gpurl.algorithms.policy_gradient import (aggregate, clipped_objective, group_advantages,
                                              kl_estimate, sequence_ratio)

RNG = np.random.default_rng(0)
B, T, G = 8, 6, 4
LOGP = RNG.normal(-2, 0.5, (B, T)).astype(np.float32)
REF = (LOGP + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
MASK = (np.arange(T)[None] < RNG.integers(1, T + 1, (B, 1))).astype(np.float32)
REWARDS = RNG.integers(0, 2, B).astype(np.float32) + RNG.normal(0, 0.1, B).astype(np.float32)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(kind):
    ratio = np.exp(REF - LOGP)  # pi_ref / pi
    expected = {"k1": -np.log(ratio), "k2": 0.5 * np.log(ratio) ** 2,
                "k3": ratio - 1 - np.log(ratio)}[kind]
    np.testing.assert_allclose(kl_estimate(jnp.asarray(LOGP), jnp.asarray(REF), kind,
                                           jnp.asarray(MASK)), expected * MASK,
                               rtol=1e-5, atol=1e-6)
    # a masked slot holding a log-prob exp() cannot take gives 0 (not inf x 0 = NaN)
    far = jnp.asarray(np.where(MASK > 0, LOGP, -1e4), jnp.float32)
    out = kl_estimate(far, jnp.asarray(REF), kind, jnp.asarray(MASK))
    np.testing.assert_allclose(out, expected * MASK, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                  "seq_mean_token_sum_norm"])
def test_aggregation_normalizers_and_micro_batch_shares_add_up(kind):
    loss = RNG.normal(size=(B, T)).astype(np.float32)
    per_seq_sum = (loss * MASK).sum(1)
    expected = {"token_mean": (loss * MASK).sum() / MASK.sum(),
                "seq_mean_token_mean": np.mean(per_seq_sum / MASK.sum(1)),
                "seq_mean_token_sum": np.mean(per_seq_sum),
                "seq_mean_token_sum_norm": np.mean(per_seq_sum / T)}[kind]
    args = dict(kind=kind, num_tokens=MASK.sum(), num_seqs=B, max_tokens=T)
    whole = aggregate(jnp.asarray(loss), jnp.asarray(MASK), **args)
    halves = sum(aggregate(jnp.asarray(loss[s]), jnp.asarray(MASK[s]), **args)
                 for s in (slice(0, B // 2), slice(B // 2, B)))
    np.testing.assert_allclose(whole, expected, rtol=1e-5)
    np.testing.assert_allclose(halves, expected, rtol=1e-5)


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_advantages(kind):
    expected = np.empty(B, np.float32)
    for g in range(B // G):
        r = REWARDS[g * G:(g + 1) * G]
        for i in range(G):
            if kind == "grpo":  # DeepSeekMath: (r_i - mean(r)) / std(r)
                expected[g * G + i] = (r[i] - r.mean()) / (r.std(ddof=1) + 1e-4)
            elif kind == "drgrpo":  # Dr. GRPO: r_i - mean(r)
                expected[g * G + i] = r[i] - r.mean()
            else:  # RLOO: r_i - mean of the others
                expected[g * G + i] = r[i] - np.delete(r, i).mean()
    np.testing.assert_allclose(group_advantages(jnp.asarray(REWARDS), G, kind), expected,
                               rtol=1e-5, atol=1e-6)


def test_equal_rewards_give_zero_advantage():
    assert np.all(np.asarray(group_advantages(jnp.ones(B), G, "grpo")) == 0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_clipped_objective(dual_clip):
    ratio = np.exp(RNG.normal(0, 1.0, (B, T))).astype(np.float32)
    adv = np.repeat(RNG.normal(size=(B, 1)), T, 1).astype(np.float32)
    eps_low, eps_high = 0.2, 0.28
    expected = np.empty_like(ratio)
    for idx in np.ndindex(ratio.shape):
        r, a = ratio[idx], adv[idx]
        surrogate = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
        if dual_clip is not None and a < 0:
            surrogate = max(surrogate, dual_clip * a)
        expected[idx] = -surrogate
    got = clipped_objective(jnp.asarray(ratio), jnp.asarray(adv), eps_low, eps_high, dual_clip)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if dual_clip is not None:  # the bound binds somewhere in this sample
        plain = clipped_objective(jnp.asarray(ratio), jnp.asarray(adv), eps_low, eps_high)
        assert np.any(np.asarray(plain) != np.asarray(got))


def test_gspo_sequence_ratio():
    old = (LOGP + RNG.normal(0, 0.2, (B, T))).astype(np.float32)
    expected = [np.exp(np.sum((LOGP[i] - old[i]) * MASK[i]) / MASK[i].sum()) for i in range(B)]
    np.testing.assert_allclose(sequence_ratio(jnp.asarray(LOGP), jnp.asarray(old), jnp.asarray(MASK)),
                               expected, rtol=1e-5)


# ---------------------------------------------------------------- the GRPO-family loss

def _np_policy_loss(logp, old, ref, adv, mask, cfg, sampler=None):
    """NumPy transcription: DeepSeekMath eq. 3 (token ratios, KL k3 in the loss), GSPO eq. 5-7
    (sequence ratio), aggregation as configured."""
    if cfg.importance == "sequence":
        s = np.exp(((logp - old) * mask).sum(1) / mask.sum(1))
        ratio = np.repeat(s[:, None], logp.shape[1], 1)
    else:
        ratio = np.exp(logp - old)
    clipped = np.clip(ratio, 1 - cfg.epsilon, 1 + cfg.clip_high)
    per_token = -np.minimum(ratio * adv[:, None], clipped * adv[:, None])
    if cfg.tis_cap is not None:  # Yao et al. 2025: min(pi_old / pi_sampler, C) per token
        per_token = per_token * np.minimum(np.exp(old - sampler), cfg.tis_cap)
    if cfg.ratio_mask == "token":  # IcePop: no gradient where pi_old / pi_sampler leaves the band
        r = np.exp(old - sampler)
        per_token = per_token * ((r >= cfg.ratio_mask_low) & (r <= cfg.ratio_mask_high))
    if cfg.beta:
        r = np.exp(ref - logp)
        per_token = per_token + cfg.beta * (r - np.log(r) - 1)
    if cfg.loss_agg == "token_mean":
        return (per_token * mask).sum() / mask.sum()
    if cfg.loss_agg == "seq_mean_token_sum_norm":  # Dr. GRPO: a constant normalizer
        return (per_token * mask).sum() / (mask.shape[0] * mask.shape[1])
    return np.mean((per_token * mask).sum(1) / mask.sum(1))


@pytest.mark.parametrize("overrides", [
    dict(name="grpo", beta=0.04),
    dict(name="gspo", importance="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(name="dapo", epsilon_high=0.28, loss_agg="token_mean"),
    dict(name="drgrpo", advantage="drgrpo", loss_agg="seq_mean_token_sum_norm"),
    dict(name="grpo", tis_cap=1.5),
    dict(name="grpo", tis_cap=2.0, ratio_mask="token", ratio_mask_low=0.7, ratio_mask_high=2.0),
])
def test_policy_loss_matches_numpy(overrides):
    from gpurl.algorithms.behaviour import off_policy_terms
    from gpurl.algorithms.policy_gradient import policy_loss

    cfg = algo_config(**overrides)
    old = (LOGP + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = RNG.normal(size=B).astype(np.float32)
    sampler = (old + RNG.normal(0, 0.5, (B, T))).astype(np.float32)
    batch = {"comp_mask": jnp.asarray(MASK), "advantages": jnp.asarray(adv),
             "old_logprobs": jnp.asarray(old), "ref_logprobs": jnp.asarray(REF),
             "sampler_logprobs": jnp.asarray(sampler)}
    # the truncated importance weights come from the prepare step, as in a run
    batch.update(off_policy_terms(cfg, False, batch["old_logprobs"], batch)[0])
    norm = {"tokens": jnp.float32(MASK.sum()), "seqs": jnp.float32(B)}
    loss, metrics = policy_loss(cfg, jnp.asarray(LOGP), batch, norm, max_tokens=T)
    np.testing.assert_allclose(loss, _np_policy_loss(LOGP, old, REF, adv, MASK, cfg, sampler),
                               rtol=1e-5)
    assert 0 <= float(metrics["clip_fraction"]) <= 1


def test_gspo_token_has_gspo_value_and_gradient():
    """GSPO-token (Zheng et al. 2025, eq. 13-14) equals GSPO in value and gradient when every
    token of a sequence has the sequence's advantage: d loss / d logp_it =
    -A_i s_i / |y_i| / B where the ratio is not clipped, 0 where it is."""
    import jax

    from gpurl.algorithms.policy_gradient import policy_loss

    old = (LOGP + RNG.normal(0, 0.1, (B, T))).astype(np.float32)
    adv = RNG.normal(size=B).astype(np.float32)
    batch = {"comp_mask": jnp.asarray(MASK), "advantages": jnp.asarray(adv),
             "old_logprobs": jnp.asarray(old)}
    norm = {"tokens": jnp.float32(MASK.sum()), "seqs": jnp.float32(B)}

    def loss_of(importance):
        cfg = algo_config("gspo", importance=importance, epsilon=0.03, epsilon_high=0.04)
        return jax.value_and_grad(lambda lp: policy_loss(cfg, lp, batch, norm, T)[0])(
            jnp.asarray(LOGP))

    (v_seq, g_seq), (v_tok, g_tok) = loss_of("sequence"), loss_of("sequence_token")
    s = np.exp(((LOGP - old) * MASK).sum(1) / MASK.sum(1))
    unclipped = np.where(adv >= 0, s <= 1.04, s >= 0.97)  # where min() picks s * A
    want = -(adv * s * unclipped / MASK.sum(1) / B)[:, None] * MASK
    assert unclipped.any() and not unclipped.all()
    np.testing.assert_allclose(v_tok, v_seq, rtol=1e-6)
    np.testing.assert_allclose(g_seq, want, atol=1e-6)
    np.testing.assert_allclose(g_tok, want, atol=1e-6)
