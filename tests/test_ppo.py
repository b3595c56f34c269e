"""PPO and reward models: GAE, token rewards, whitening and the losses against NumPy
transcriptions of the papers' equations; the adaptive KL controller; tiny runs where the
reward rises; a reward model trained here that transformers scores identically and that
PPO then optimizes."""

from __future__ import annotations

import json
import string

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, algo_config, make_config
from gpurl.algorithms.policy_gradient import policy_loss
from gpurl.algorithms.ppo import adaptive_kl_coef, gae, masked_whiten, token_rewards, value_loss
from gpurl.config import ConfigError, KLControlConfig
from gpurl.train.loop import train

# ---------------------------------------------------------------- the papers' equations


def gae_numpy(r, v, lengths, gamma, lam):
    """Schulman et al. 2016, eqs. 11-16, one sequence at a time; V after the end is 0."""
    adv = np.zeros_like(r)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_v = v[b, t + 1] if t + 1 < n else 0.0
            delta = r[b, t] + gamma * next_v - v[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    mask = np.arange(r.shape[1])[None] < np.asarray(lengths)[:, None]
    return adv, (adv + v) * mask


def token_rewards_numpy(score, kl, lengths, beta):
    """Ziegler et al. 2019, eq. 2: -beta KL on every token, the score on the last."""
    r = np.zeros_like(kl)
    for b, n in enumerate(lengths):
        r[b, :n] = -beta * kl[b, :n]
        if n:
            r[b, n - 1] += score[b]
    return r


def value_loss_numpy(v, v_old, ret, lengths, clip):
    """OpenAI baselines' PPO2 clipped value loss, 0.5 max(unclipped, clipped), token mean."""
    terms = []
    for b, n in enumerate(lengths):
        for t in range(n):
            clipped = v_old[b, t] + np.clip(v[b, t] - v_old[b, t], -clip, clip)
            terms.append(0.5 * max((v[b, t] - ret[b, t]) ** 2, (clipped - ret[b, t]) ** 2))
    return np.mean(terms)


def surrogate_numpy(logp, old, adv, lengths, eps):
    """Schulman et al. 2017, eq. 7, per token, token mean."""
    terms = []
    for b, n in enumerate(lengths):
        for t in range(n):
            ratio = np.exp(logp[b, t] - old[b, t])
            terms.append(-min(ratio * adv[b, t], np.clip(ratio, 1 - eps, 1 + eps) * adv[b, t]))
    return np.mean(terms)


def _random_batch(seed, b=6, n=7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, n + 1, size=b)
    lengths[0] = n  # at least one full row
    mask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return lengths, mask, f


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_and_token_rewards_equal_numpy(gamma, lam):
    lengths, mask, f = _random_batch(0)
    score, kl, values = f(6), np.abs(f(6, 7)), f(6, 7)
    r = np.asarray(token_rewards(jnp.asarray(score), jnp.asarray(kl * mask), jnp.asarray(mask), 0.05))
    np.testing.assert_allclose(r, token_rewards_numpy(score, kl, lengths, 0.05), atol=1e-6)
    adv, ret = gae(jnp.asarray(r), jnp.asarray(values * mask), jnp.asarray(mask), gamma, lam)
    adv_np, ret_np = gae_numpy(r, values, lengths, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), adv_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ret_np, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_crosses_observation_spans_as_if_they_were_not_there(gamma, lam):
    """A multi-turn trajectory: model tokens, an observation span (mask 0), model tokens,
    another span, padding. GAE over the masked row equals the paper's GAE over the
    row's model tokens alone, scattered back (observation tokens 0), and the score sits
    on the last model token, not on the last token before a span."""
    rng = np.random.default_rng(3)
    n = 12
    mask = np.zeros((3, n), np.float32)
    mask[0, [0, 1, 2, 5, 6, 9]] = 1  # spans 3-4 and 7-8, padding 10-11
    mask[1, [0, 3, 4, 5, 6, 7]] = 1
    mask[2, :7] = 1  # one turn
    score, kl, values = rng.normal(size=3), np.abs(rng.normal(size=(3, n))), rng.normal(size=(3, n))
    kl, values = (kl * mask).astype(np.float32), (values * mask).astype(np.float32)
    r = np.asarray(token_rewards(jnp.asarray(score, jnp.float32), jnp.asarray(kl),
                                 jnp.asarray(mask), 0.05))
    adv, ret = (np.asarray(x) for x in gae(jnp.asarray(r), jnp.asarray(values), jnp.asarray(mask),
                                           gamma, lam))
    for b in range(3):
        on = np.flatnonzero(mask[b])
        m = len(on)
        want_r = token_rewards_numpy(score[b:b + 1], kl[b:b + 1, on], [m], 0.05)
        np.testing.assert_allclose(r[b, on], want_r[0], atol=1e-6)
        adv_np, ret_np = gae_numpy(want_r, values[b:b + 1, on], [m], gamma, lam)
        np.testing.assert_allclose(adv[b, on], adv_np[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[b, on], ret_np[0], rtol=1e-5, atol=1e-5)
        off = mask[b] == 0
        assert not adv[b, off].any() and not ret[b, off].any() and not r[b, off].any()


def test_whitening_and_losses_equal_numpy():
    lengths, mask, f = _random_batch(1)
    x = f(6, 7)
    real = x[mask > 0]
    want = (x - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(masked_whiten(jnp.asarray(x), jnp.asarray(mask))), want,
                               rtol=1e-5, atol=1e-5)
    v, v_old, ret = f(6, 7), f(6, 7), f(6, 7)
    tokens = jnp.float32(mask.sum())
    for clip in (0.2, None):
        got = value_loss(jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask),
                         clip, tokens)
        want = value_loss_numpy(v, v_old, ret, lengths, 1e9 if clip is None else clip)
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
    logp, old, adv = -np.abs(f(6, 7)), -np.abs(f(6, 7)), f(6, 7)
    cfg = algo_config("ppo", num_generations=1, epsilon=0.2, loss_agg="token_mean",
                     beta=0.05, kl_in_reward=True)
    rows = {"comp_mask": jnp.asarray(mask), "old_logprobs": jnp.asarray(old),
            "advantages": jnp.asarray(adv)}
    norm = {"tokens": tokens, "seqs": jnp.float32((lengths > 0).sum())}
    got, metrics = policy_loss(cfg, jnp.asarray(logp), rows, norm, 7)
    np.testing.assert_allclose(float(got), surrogate_numpy(logp, old, adv, lengths, 0.2), rtol=1e-5)
    assert "kl" not in metrics  # the KL is in the reward, not the loss


def test_adaptive_kl_follows_ziegler():
    """beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) rows / horizon) (Ziegler 2019);
    the coefficient is a float32 on device, carried from step to step."""
    cfg = KLControlConfig(kl_target=6.0, kl_horizon=100)
    beta, want = jnp.float32(0.1), 0.1
    for observed in (12.0, 6.6, 1.0, 6.0):
        beta = adaptive_kl_coef(cfg, beta, jnp.float32(observed), rows=32)
        want *= 1 + np.clip(observed / 6.0 - 1, -0.2, 0.2) * 32 / 100
        assert float(beta) == pytest.approx(want, rel=1e-6)
    fixed = adaptive_kl_coef(KLControlConfig(kl_target=None, kl_horizon=100), jnp.float32(0.1),
                             jnp.float32(50.0), rows=32)
    assert float(fixed) == np.float32(0.1)


def test_the_adaptive_kl_counts_trained_rows_not_fillers():
    """A batch whose second group is dynamic sampling's fillers (no token carries loss): the
    KL the controller reads is the mean summed KL over the trained rows, and the step counts
    those rows; before, the fillers' zeros halved the KL and beta drifted down."""
    from gpurl.algorithms import ppo
    from gpurl.algorithms.forward import group_logprobs
    from gpurl.algorithms.policy_gradient import kl_estimate
    from gpurl.algorithms.rl import RLContext, RLInputs
    from gpurl.models.scalar import ActorCriticSpec

    cfg = algo_config("ppo", num_generations=2, beta=0.1, kl_target=0.5, kl_horizon=8,
                      kl_in_reward=True, kl_estimator="k1", critic="shared")
    spec = ActorCriticSpec.of(make_config(model=TINY_MODEL).model, cfg.critic)
    params, ref = spec.init(0), spec.policy.init(1)
    rng = np.random.default_rng(2)
    p, g, n, w = 2, 2, 5, 6
    clen = np.asarray([[5, 3], [4, 2]])
    keep = np.asarray([[1.0], [0.0]])[..., None]  # the second prompt's group: fillers
    batch = {"prompt_tokens": jnp.asarray(rng.integers(1, 250, (p, w)), jnp.int32),
             "prompt_lengths": jnp.asarray([4, 6]),
             "completions": jnp.asarray(rng.integers(1, 250, (p, g, n)), jnp.int32),
             "completion_lengths": jnp.asarray(clen),
             "comp_mask": jnp.asarray((np.arange(n) < clen[..., None]) * keep, jnp.float32),
             "sampler_logprobs": jnp.zeros((p, g, n))}
    _, stats, carry = ppo.prepare(cfg, RLContext(spec, 1.0), RLInputs(
        params, ref, None, batch, jnp.zeros(p * g), ppo.initial_carry(cfg)))
    old = group_logprobs(spec.policy, params["policy"], batch)[0].reshape(-1, n)
    ref_logp = group_logprobs(spec.policy, ref, batch, replay=False)[0].reshape(-1, n)
    mask = batch["comp_mask"].reshape(-1, n)
    kl_B = np.asarray(kl_estimate(old, ref_logp, "k1", mask)).sum(-1)
    assert abs(kl_B[:2]).min() > 1e-3 and not kl_B[2:].any()
    want = kl_B[:2].mean()  # the trained rows' mean, not over all four
    assert float(stats["kl/rollout"]) == pytest.approx(want, rel=1e-5)
    assert float(carry["kl_coef"]) == pytest.approx(
        0.1 * (1 + np.clip(want / 0.5 - 1, -0.2, 0.2) * 2 / 8), rel=1e-5)


def test_ppo_config_errors():
    with pytest.raises(ConfigError, match="kl_in_reward=true"):
        algo_config("ppo", beta=0.05, kl_in_reward=False)
    with pytest.raises(ConfigError, match="algo.critic"):
        algo_config("ppo", critic="both", kl_in_reward=True)
    with pytest.raises(ConfigError, match="starts at algo.beta=0"):
        algo_config("ppo", beta=0.0, kl_target=6.0)
    algo_config("ppo", num_generations=1, beta=0.05, kl_in_reward=True)  # G=1 is classic PPO


# ---------------------------------------------------------------- tiny runs


def letters(prompts, completions, **_):
    """Share of a completion's characters that are lowercase letters."""
    return [sum(c in string.ascii_lowercase for c in t) / max(len(t), 1) for t in completions]


def ppo_config(tmp_path, run: str, steps: int, data=None, rewards=("test_grpo:printable",),
               reward_weights=(), **algo):
    return make_config(
        algo={"name": "ppo", "num_generations": 4, "beta": 0.05, "kl_in_reward": True,
              "kl_estimator": "k1", "loss_agg": "token_mean", "critic_lr": 1e-2,
              "vf_coef": 0.1, **algo},
        model=dict(TINY_MODEL, tokenizer="bytes"),
        data=data or {"name": "arithmetic", "num_train": 64, "num_eval": 8, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": steps, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
               "eval_batch_size": 16, "eval_pass_k": 2},
        rollout={"max_new_tokens": 8, "temperature": 1.0},
        logger={"progress": False}, run={"dir": str(tmp_path / run)},
        rewards={"functions": tuple(rewards), "weights": tuple(reward_weights)})


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


@pytest.mark.e2e
def test_tiny_ppo_raises_reward_and_fits_values(tmp_path):
    summary = train(ppo_config(tmp_path, "ppo", steps=25))
    rows = _steps(tmp_path / "ppo")
    rewards = np.asarray([r["reward/mean"] for r in rows])
    assert len(rows) == 25
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.25, rewards
    assert summary["eval/pass@1"] > summary["start"]["eval/pass@1"] + 0.3, summary
    # the critic learns: its error on the returns falls, and its values track the reward
    errors = np.asarray([r["value_error"] for r in rows])
    assert errors[-5:].mean() < 0.5 * errors[:3].mean(), errors
    assert abs(rows[-1]["values/mean"] - rows[-1]["returns/mean"]) < 0.2
    for key in ("policy_loss", "value_loss", "entropy", "kl/rollout", "clip_fraction"):
        assert key in rows[-1]


@pytest.mark.e2e
def test_shared_critic_entropy_bonus_and_adaptive_kl(tmp_path):
    """The value head on the policy's backbone, an entropy bonus and the adaptive KL
    coefficient, whose logged values follow the controller's rule step by step; the KL
    coefficient is checkpointed, so a resumed run continues from its value."""
    cfg = ppo_config(tmp_path, "shared", steps=20, critic="shared", entropy_coef=0.01,
                     kl_target=0.5, kl_horizon=40, beta=0.1)
    train(cfg)
    rows = _steps(tmp_path / "shared")
    rewards = np.asarray([r["reward/mean"] for r in rows])
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.15, rewards
    coef = 0.1
    for r in rows:
        assert r["kl/coef"] == pytest.approx(coef, rel=1e-5)
        coef *= 1 + np.clip(r["kl/rollout"] / 0.5 - 1, -0.2, 0.2) * 16 / 40
    assert rows[-1]["kl/coef"] != pytest.approx(0.1, rel=1e-3)
    meta = json.loads(next((tmp_path / "shared" / "checkpoints").glob("*/meta/metadata"))
                      .read_text())
    assert meta["kl_coef"] == pytest.approx(coef, rel=1e-5)


def _letter_prompts(path, n, seed):
    rng = np.random.default_rng(seed)
    rows = [{"prompt": "".join(rng.choice(list(string.ascii_lowercase), 4)) + " ->"}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.e2e
def test_reward_model_trains_matches_transformers_and_drives_ppo(tmp_path):
    """algo=rm learns letters-over-digits pairs; its export scores sequences exactly as
    transformers' ...ForSequenceClassification does; PPO with it as algo.reward_model
    raises the learned reward (the reward functions then only report)."""
    import torch
    import transformers

    from gpurl.algorithms.rm import reward_model_scores
    from gpurl.commands.export import export_run
    from gpurl.config import MeshConfig
    from gpurl.distributed.mesh import trainer_mesh
    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.rollout.prompts import encode_prompt
    from gpurl.train.weights import load_reward_model
    from test_dpo import MODEL, _letters_vs_digits

    _letters_vs_digits(tmp_path / "prefs.jsonl", 160, seed=0)
    rm_cfg = make_config(
        algo={"name": "rm"}, model=MODEL,
        data={"name": "jsonl", "path": str(tmp_path / "prefs.jsonl"), "num_eval": 32, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 20, "batch_size": 16, "micro_batch_size": 8, "eval_every": 0,
               "checkpoint_every": 0, "eval_batch_size": 32},
        logger={"progress": False}, run={"dir": str(tmp_path / "rm")})
    summary = train(rm_cfg)
    assert summary["start"]["eval/rewards/accuracy"] == 0.0  # zero head: every pair tied
    assert summary["eval/rewards/accuracy"] >= 0.9 and summary["eval/loss"] < 0.3, summary

    out = export_run(tmp_path / "rm", tmp_path / "rm_hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    texts = [("abcd ->", " xyz"), ("qrst ->", " 123"), ("mnop ->", " a1"), ("wxyz ->", "")]
    tok = byte_tokenizer()
    ids = [(encode_prompt(tok, p, False), tok.encode(c)) for p, c in texts]
    with torch.no_grad():
        want = [float(hf(torch.tensor([p + c])).logits[0, 0]) for p, c in ids]
    spec, params = load_reward_model(str(out), rm_cfg.model,
                                     trainer_mesh(MeshConfig(data=1, fsdp=-1)),
                                     rm_cfg.mesh.train_rules)
    width, n = 16, 4
    batch = {"prompt_tokens": jnp.asarray([p + [0] * (width - len(p)) for p, _ in ids]),
             "prompt_lengths": jnp.asarray([len(p) for p, _ in ids]),
             "completions": jnp.asarray([[c + [0] * (n - len(c))] for _, c in ids]),
             "completion_lengths": jnp.asarray([[len(c)] for _, c in ids])}
    got = np.asarray(reward_model_scores(spec, params, batch))
    np.testing.assert_allclose(got, want, atol=2e-5)

    _letter_prompts(tmp_path / "prompts.jsonl", 72, seed=3)
    cfg = ppo_config(tmp_path, "ppo_rm", steps=25, rewards=("test_ppo:letters",),
                     data={"name": "jsonl", "path": str(tmp_path / "prompts.jsonl"),
                           "num_eval": 8, "max_len": 16},
                     reward_weights=(0.0,), reward_model=str(out))  # letters: reported only
    train(cfg)
    rows = _steps(tmp_path / "ppo_rm")
    learned = np.asarray([r["reward/model"] for r in rows])
    # Random bytes already score high (they are not digits); the headroom is ~0.5. A step's
    # learned reward swings by +-1 (2.2 to 4.3), so the first and last 10 steps are compared
    # (+0.47 and +0.48 under two compilers' float32 rounding; 4-step means moved 0.3 with it)
    assert learned[-10:].mean() > learned[:10].mean() + 0.2, learned.tolist()
    # the training reward is the learned one: the letters share has weight 0
    assert all(r["reward/mean"] == pytest.approx(r["reward/model"], abs=1e-4) for r in rows)
    assert "reward/test_ppo:letters" in rows[-1]
