"""DPO, IPO, hinge, cDPO, SimPO and ORPO: losses against NumPy transcriptions of the
papers' equations, pair data, micro-batch additivity, and a tiny model that learns a
preference."""

from __future__ import annotations

import dataclasses
import functools
import json
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, algo_config, make_config
from gpurl.algorithms import registry
from gpurl.algorithms.dpo import sequence_logps
from gpurl.algorithms.forward import token_logprobs
from gpurl.config import ConfigError, DataConfig, RolloutConfig
from gpurl.data.preferences import encode_pairs, load_pairs, take_pairs
from gpurl.data.sources import load_examples
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import model_spec
from gpurl.models.tokenizer import byte_tokenizer
from gpurl.train.loop import train
from gpurl.train.optim import make_optimizer
from gpurl.train.step import accumulate_grads, placement


# ---------------------------------------------------------------- the papers' equations

def _logsig(x):
    return -np.logaddexp(0.0, -x)


def dpo_numpy(pw, pl, rw, rl, beta, kind, eps=0.0):
    """Rafailov et al. 2023 eq. 7 (+ Mitchell 2023's cDPO), Azar et al. 2023 eq. 17, SLiC hinge."""
    h = (pw - rw) - (pl - rl)
    if kind == "sigmoid":
        return -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h)
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return np.maximum(0.0, 1 - beta * h)


def simpo_numpy(pw, pl, lw, ll, beta, gamma, eps=0.0):
    """Meng et al. 2024 eq. 6 (label smoothing as cDPO)."""
    z = beta / lw * pw - beta / ll * pl - gamma
    return -(1 - eps) * _logsig(z) - eps * _logsig(-z)


def orpo_numpy(pw, pl, lw, ll, lam):
    """Hong et al. 2024 eqs. 6-7: L_SFT + lambda L_OR, odds = P / (1 - P), P = exp(mean log p)."""
    with np.errstate(all="ignore"):  # the garbage of padding pairs; they are masked out
        p_w, p_l = np.exp(pw / lw), np.exp(pl / ll)
        log_odds_ratio = np.log(p_w / (1 - p_w)) - np.log(p_l / (1 - p_l))
        return -pw / lw - lam * _logsig(log_odds_ratio)


def _random_pairs(seed: int, p: int = 12, n: int = 6):
    """Summed log-probs of masked token log-probs (garbage in masked slots), and a pair
    mask with two padding pairs whose values are garbage too."""
    rng = np.random.default_rng(seed)
    len_Px2 = rng.integers(1, n + 1, (p, 2)).astype(np.float32)
    mask_Px2xN = (np.arange(n) < len_Px2[..., None]).astype(np.float32)
    tok_Px2xN = np.where(mask_Px2xN > 0, rng.uniform(-3.0, -0.01, (p, 2, n)), 1e4)
    logp_Px2 = (np.where(mask_Px2xN > 0, tok_Px2xN, 0.0)).sum(-1).astype(np.float32)
    ref_Px2 = (logp_Px2 + rng.normal(0, 1.0, (p, 2))).astype(np.float32)
    pair_mask_P = np.ones(p, np.float32)
    pair_mask_P[[3, 7]] = 0.0
    logp_Px2[[3, 7]] = 1e3  # padding pairs: nothing of them may leak into the mean
    return logp_Px2, ref_Px2, len_Px2, pair_mask_P


CASES = [("dpo", dict(beta=0.1, dpo_loss="sigmoid")),
         ("dpo", dict(beta=0.5, dpo_loss="sigmoid", label_smoothing=0.2)),
         ("dpo", dict(beta=0.1, dpo_loss="ipo")),
         ("dpo", dict(beta=0.3, dpo_loss="hinge")),
         ("simpo", dict(beta=2.0, simpo_gamma=0.5)),
         ("simpo", dict(beta=2.5, simpo_gamma=1.0, label_smoothing=0.1)),
         ("orpo", dict(orpo_lambda=0.1)),
         ("orpo", dict(orpo_lambda=1.0))]


@pytest.mark.parametrize("name,fields", CASES)
def test_losses_equal_numpy_transcriptions(name, fields):
    cfg = algo_config(name, **fields)
    pair_loss = registry.get(name).objective(cfg, RolloutConfig()).pair_loss
    logp, ref, length, pair_mask = _random_pairs(seed=len(str(fields)))
    real = pair_mask > 0
    pw, pl, rw, rl = logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1]
    lw, ll = length[:, 0], length[:, 1]
    if name == "dpo":
        expected = dpo_numpy(pw, pl, rw, rl, cfg.beta, cfg.dpo_loss, cfg.label_smoothing)
        reward_w, reward_l = cfg.beta * (pw - rw), cfg.beta * (pl - rl)
    elif name == "simpo":
        expected = simpo_numpy(pw, pl, lw, ll, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing)
        reward_w, reward_l = cfg.beta * pw / lw, cfg.beta * pl / ll
    else:
        expected = orpo_numpy(pw, pl, lw, ll, cfg.orpo_lambda)
        reward_w, reward_l = pw / lw, pl / ll
    # The global batch is split in two micro-batches; their shares add up to the mean.
    norm = jnp.float32(real.sum())
    shares = [pair_loss(jnp.asarray(logp[s]), jnp.asarray(length[s]), jnp.asarray(ref[s]),
                        jnp.asarray(pair_mask[s]), norm) for s in (slice(0, 6), slice(6, None))]
    loss = sum(float(share[0]) for share in shares)
    metric = lambda k: sum(float(share[1][k]) for share in shares)  # noqa: E731
    np.testing.assert_allclose(loss, expected[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(metric("loss"), loss, rtol=1e-6)
    np.testing.assert_allclose(metric("rewards/chosen"), reward_w[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(metric("rewards/margin"), (reward_w - reward_l)[real].mean(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metric("rewards/accuracy"), (reward_w > reward_l)[real].mean(),
                               rtol=1e-6)


def test_preference_config_errors():
    with pytest.raises(ConfigError, match="label_smoothing.*algo.dpo_loss=sigmoid"):
        algo_config("dpo", beta=0.1, dpo_loss="ipo", label_smoothing=0.1)
    with pytest.raises(ConfigError, match="algo.dpo_loss='kto' is not valid"):
        algo_config("dpo", beta=0.1, dpo_loss="kto")
    with pytest.raises(ConfigError, match="algo.beta=0.0"):
        algo_config("simpo", beta=0.0)
    with pytest.raises(ConfigError, match="data=arithmetic has no preference pairs"):
        load_pairs(DataConfig(name="arithmetic"))


def test_presets_compose():
    from gpurl.cli import validate

    dpo = validate(["algo=dpo", "data=addition_prefs"])
    assert (dpo.algo.name, dpo.algo.beta, dpo.algo.dpo_loss, dpo.algo.label_smoothing) == (
        "dpo", 0.1, "sigmoid", 0.0)
    assert (dpo.data.name, dpo.data.few_shot, dpo.data.append_eos) == ("arithmetic_prefs", 4, False)
    assert dpo.run.dir == "runs/dpo-gemma3_270m-addition_prefs"  # the data preset's name
    ipo = validate(["algo=ipo"]).algo
    assert (ipo.name, ipo.dpo_loss, ipo.beta) == ("dpo", "ipo", 0.1)
    simpo = validate(["algo=simpo"]).algo
    assert (simpo.beta, simpo.simpo_gamma) == (2.0, 0.5)
    assert validate(["algo=orpo"]).algo.orpo_lambda == 0.1
    cdpo = validate(["algo=dpo", "algo.label_smoothing=0.1"]).algo
    assert cdpo.label_smoothing == 0.1


# ---------------------------------------------------------------- data

def test_addition_prefs_pairs():
    cfg = DataConfig(name="arithmetic_prefs", a_range=[10, 99], b_range=[1, 9], ops=["+"],
                     few_shot=4, num_train=710, num_eval=100, max_len=64)
    train_rows, eval_rows = load_pairs(cfg)
    assert (train_rows, eval_rows) == load_pairs(cfg)  # deterministic by seed
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in eval_rows}
    assert len(eval_rows) == 100
    # The same problems, prompts and split as data=arithmetic with these fields.
    same = load_examples(dataclasses.replace(cfg, name="arithmetic"))
    assert [r["prompt"] for r in same[1]] == [r["prompt"] for r in eval_rows]
    for row in train_rows + eval_rows:
        query = row["prompt"].splitlines()[-1]
        a, b = (int(x) for x in query.rstrip(" =").split(" + "))
        assert row["chosen"] == f" {a + b}" and row["answer"] == str(a + b)
        wrong = int(row["rejected"])
        assert wrong >= 0 and 1 <= abs(wrong - (a + b)) <= 10
    gaps = [int(r["rejected"]) - int(r["answer"]) for r in train_rows]
    assert min(gaps) == -10 and max(gaps) == 10


def test_jsonl_pairs_and_errors(tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"q{i}", "chosen": " yes", "rejected": " no", "id": i} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(name="jsonl", path=str(path), num_eval=2, max_len=8)
    train_rows, eval_rows = load_pairs(cfg)
    assert len(train_rows) == 4 and len(eval_rows) == 2 and "id" in eval_rows[0]
    pairs = encode_pairs(train_rows, byte_tokenizer(), cfg, "train")
    batch = take_pairs(pairs, np.asarray([2, -1]))
    tok = byte_tokenizer()
    assert batch["completions"][0, 0, :5].tolist() == tok.encode(" yes") + [tok.eos_id]
    assert batch["comp_mask"][0].sum(-1).tolist() == [5, 4] and batch["comp_mask"][1].sum() == 0
    assert batch["pair_mask"].tolist() == [1.0, 0.0]
    long_cfg = dataclasses.replace(cfg, max_len=4)  # BOS + "q0" + " yes" + EOS > 4
    with pytest.raises(ConfigError, match="every train pair is longer than data.max_len=4"):
        encode_pairs(train_rows, tok, long_cfg, "train")
    path.write_text(json.dumps({"prompt": "q", "chosen": " a"}) + "\n")
    with pytest.raises(ConfigError, match=r'prefs.jsonl has no preference pairs \(columns: '
                                          r'chosen, prompt\); give rows'):
        load_pairs(cfg)
    path.write_text(json.dumps({"prompt": "q", "chosen": " a", "rejected": " a"}) + "\n")
    with pytest.raises(ConfigError, match="row 1: \"chosen\" and \"rejected\" are the same"):
        list(load_pairs(dataclasses.replace(cfg, num_eval=0))[0])


# ---------------------------------------------------------------- with the model

MODEL = dict(TINY_MODEL, tokenizer="bytes")


@functools.cache
def _model_pieces():
    cfg = make_config(model=MODEL, algo={"name": "dpo", "beta": 0.1})
    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, 10)
    place = placement(spec, optimizer, trainer_mesh(cfg.mesh), cfg.mesh.train_rules)
    return spec, place, spec.init(0)


def _pair_batch(n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    word = lambda k: "".join(rng.choice(list(string.ascii_lowercase), k))  # noqa: E731
    rows = [{"prompt": word(int(rng.integers(2, 7))), "chosen": " " + word(int(rng.integers(1, 4))),
             "rejected": " " + word(int(rng.integers(1, 5)))} for _ in range(n)]
    pairs = encode_pairs(rows, byte_tokenizer(), DataConfig(name="jsonl", path="x", max_len=16),
                         "train")
    return rows, take_pairs(pairs, np.arange(n))


def test_pair_logps_equal_full_sequence_forward():
    """The encoded pair's log-probs equal a plain forward pass over BOS + prompt +
    completion + EOS, summed over the completion and EOS tokens."""
    spec, _, params = _model_pieces()
    rows, batch = _pair_batch()
    tok = byte_tokenizer()
    logp_Px2, len_Px2 = jax.jit(functools.partial(sequence_logps, spec))(params, batch)
    width, seqs, starts = 24, [], []
    for row in rows:
        for field in ("chosen", "rejected"):
            prompt = [tok.bos_id] + tok.encode(row["prompt"])
            seqs.append(prompt + tok.encode(row[field]) + [tok.eos_id])
            starts.append(len(prompt) - 1)  # the first logit that predicts a completion token
    tokens = np.zeros((len(seqs), width), np.int32)
    segments = np.zeros((len(seqs), width), np.int32)
    for r, ids in enumerate(seqs):
        tokens[r, :len(ids)], segments[r, :len(ids)] = ids, 1
    flat = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments),
            "positions": jnp.broadcast_to(jnp.arange(width), tokens.shape)}
    lp_BxT = np.asarray(jax.jit(functools.partial(token_logprobs, spec.apply))(params, flat))
    for r, (ids, start) in enumerate(zip(seqs, starts)):
        lp = lp_BxT[r, start:len(ids) - 1]
        assert len_Px2[r // 2, r % 2] == len(lp)
        np.testing.assert_allclose(logp_Px2[r // 2, r % 2], lp.sum(), rtol=1e-5)


@pytest.mark.slow
def test_micro_batches_add_up():
    """DPO's gradients and metrics of 4 micro-batches of 2 pairs equal one batch of 8."""
    spec, place, params = _model_pieces()
    cfg = make_config(algo={"name": "dpo", "beta": 0.1})
    objective = registry.get("dpo").objective(cfg.algo, cfg.rollout)
    batch = dict(_pair_batch()[1])
    batch["ref_logps"] = np.random.default_rng(1).normal(-8, 1, (8, 2)).astype(np.float32)
    batch = jax.device_put(batch, place.batch)
    grads = lambda m: jax.jit(functools.partial(  # noqa: E731
        accumulate_grads, spec, objective, place, m))(params, batch)
    (g4, m4), (g1, m1) = grads(4), grads(1)
    for k in ("loss", "rewards/accuracy", "rewards/margin", "tokens"):
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def starts_with_letters(prompts, completions, **_):
    """Task reward of the letters-vs-digits set: the completion begins with a lowercase letter."""
    return [float(text.strip()[:1] in string.ascii_lowercase and text.strip() != "")
            for text in completions]


def _letters_vs_digits(path, n: int, seed: int) -> None:
    """Prompts of random letters; chosen = more lowercase letters, rejected = digits: a
    preference a tiny model can generalize to unseen prompts."""
    rng = np.random.default_rng(seed)
    pick = lambda chars, k: "".join(rng.choice(list(chars), k))  # noqa: E731
    rows = [{"prompt": pick(string.ascii_lowercase, 4) + " ->",
             "chosen": " " + pick(string.ascii_lowercase, 3),
             "rejected": " " + pick(string.digits, 3)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.e2e
def test_tiny_dpo_learns_preference(tmp_path):
    _letters_vs_digits(tmp_path / "prefs.jsonl", 160, seed=0)
    cfg = make_config(
        algo={"name": "dpo", "beta": 0.1}, model=MODEL,
        data={"name": "jsonl", "path": str(tmp_path / "prefs.jsonl"), "num_eval": 32,
              "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 30, "batch_size": 16, "micro_batch_size": 8, "eval_every": 0,
               "checkpoint_every": 0, "eval_batch_size": 32},
        rollout={"max_new_tokens": 4, "temperature": 1.0},
        logger={"progress": False}, run={"dir": str(tmp_path / "run")},
        rewards=["test_dpo:starts_with_letters"])
    summary = train(cfg)
    start = summary["start"]
    assert start["eval/rewards/accuracy"] == 0.0  # policy == reference: every reward is 0
    assert summary["eval/rewards/accuracy"] >= 0.9, summary
    assert summary["eval/logp_accuracy"] >= 0.9 > start["eval/logp_accuracy"] + 0.2, summary
    assert summary["eval/rewards/margin"] > 0.5 and summary["eval/loss"] < 0.5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in rows if "rewards/accuracy" in r and "eval/loss" not in r]
    assert len(steps) == 30
    assert np.mean([r["rewards/accuracy"] for r in steps[-5:]]) >= 0.9
    # Task accuracy (greedy generation scored by the run's reward) is measured at start and
    # end; it need not rise here: DPO moves the chosen completion's likelihood relative to
    # the rejected one, and the random model's greedy text is neither.
    assert 0.0 <= start["eval/accuracy"] <= 1.0 and 0.0 <= summary["eval/accuracy"] <= 1.0


def test_reference_free_algorithms_skip_the_reference(tmp_path, monkeypatch):
    """SimPO and ORPO never build or run a reference model (DPO's reference pass is checked
    by the tiny run: its implicit rewards start at exactly 0)."""
    from gpurl.train import frozen, preference
    from gpurl.train.stepper import Setup

    _letters_vs_digits(tmp_path / "prefs.jsonl", 24, seed=1)
    spec, place, _ = _model_pieces()
    seen = {}

    def step_fn(state, batch, teacher):
        seen.update(batch)
        return state, {}

    def init(*_):
        raise AssertionError("a reference-free algorithm built the reference model")

    monkeypatch.setattr(frozen, "initial_policy", init)
    for name, fields in (("simpo", {"beta": 2.0}), ("orpo", {})):
        cfg = make_config(algo={"name": name, **fields}, model=MODEL,
                          data={"name": "jsonl", "path": str(tmp_path / "prefs.jsonl"),
                                "num_eval": 8, "max_len": 16},
                          train={"batch_size": 8})
        algorithm = registry.get(name)
        setup = Setup(algorithm, cfg.algo, spec, algorithm.objective(cfg.algo, cfg.rollout),
                      byte_tokenizer(), place, step_fn, init,
                      frozen.Frozen.of(algorithm, cfg.algo, spec, place, cfg.mesh, False, 0))
        stepper = preference.PreferenceStepper.build(setup, cfg)
        seen.clear()
        stepper.step(None, 0)
        assert stepper.reference is None and "ref_logps" not in seen
        assert seen["completions"].shape[:2] == (8, 2) and seen["pair_mask"].sum() == 8


@pytest.mark.e2e
def test_resumed_dpo_run_equals_uninterrupted_run(tmp_path):
    """The pair batch of step s is a function of the seed and s, and the reference is
    rebuilt from the initial weights: stopping after 2 steps and resuming gives the same
    losses and parameters as 4 straight steps."""
    from gpurl.train.restore import restore_run

    _letters_vs_digits(tmp_path / "prefs.jsonl", 64, seed=2)

    def cfg_for(run, steps):
        return make_config(
            algo={"name": "dpo", "beta": 0.1}, model=MODEL,
            data={"name": "jsonl", "path": str(tmp_path / "prefs.jsonl"), "num_eval": 8,
                  "max_len": 16},
            optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
            train={"steps": steps, "batch_size": 8, "eval_every": 0, "checkpoint_every": 2,
                   "eval_batch_size": 8},
            rollout={"max_new_tokens": 4}, logger={"progress": False},
            run={"dir": str(tmp_path / run)}, rewards=["test_dpo:starts_with_letters"])

    train(cfg_for("straight", 4))
    train(cfg_for("resumed", 2))
    train(cfg_for("resumed", 4))
    keys = ("loss", "rewards/accuracy", "rewards/margin", "grad_norm")

    def rows(run):
        lines = (tmp_path / run / "metrics.jsonl").open()
        return [{k: r[k] for k in keys} for r in map(json.loads, lines)
                if "loss" in r and "eval/loss" not in r]

    assert len(rows("straight")) == 4 and rows("straight") == rows("resumed")
    (_, a), (_, b) = restore_run(tmp_path / "straight"), restore_run(tmp_path / "resumed")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
