"""Distillation from a frozen teacher (`gpurl/algorithms/distill.py`): the per-token
divergences against NumPy transcriptions of their definitions (whole and vocabulary-chunked),
a student that is its own teacher gets no signal and no update, the teacher's checks and
its place on the mesh and in the memory plan, and tiny students that learn tiny teachers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, algo_config as registry_config, make_config, tiny_teacher
from gpurl.algorithms import distill
from gpurl.config import ConfigError
from gpurl.kernels.logprob import chunked_pair_head

# ---------------------------------------------------------------- NumPy transcriptions


def _np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _np_kl(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(P || Q) = sum_v P(v) log(P(v) / Q(v))."""
    p = np.exp(p_log)
    return (p * (p_log - q_log)).sum(-1)


def _np_jsd(s_log: np.ndarray, t_log: np.ndarray, beta: float) -> np.ndarray:
    """GKD, Agarwal et al. 2024, eq. 4 with P = teacher, Q = student:
    beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q."""
    m_log = np.log(beta * np.exp(t_log) + (1 - beta) * np.exp(s_log))
    return beta * _np_kl(t_log, m_log) + (1 - beta) * _np_kl(s_log, m_log)


def _np_top_k_reverse(s_log: np.ndarray, t_log: np.ndarray, k: int) -> np.ndarray:
    """KL between both distributions restricted to the student's k likeliest tokens and
    renormalized there."""
    out = np.zeros(s_log.shape[:-1])
    for idx in np.ndindex(*s_log.shape[:-1]):
        top = np.argsort(-s_log[idx])[:k]
        out[idx] = _np_kl(_np_log_softmax(s_log[idx][top]), _np_log_softmax(t_log[idx][top]))
    return out


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    return rng.normal(0, 2.0, (3, 5, 40)), rng.normal(0, 2.0, (3, 5, 40))


def test_divergences_match_their_definitions(logits):
    zs, zt = logits
    s, t = _np_log_softmax(zs), _np_log_softmax(zt)
    js, jt = jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32)
    cases = {"forward": (distill.forward_kl(js, jt), _np_kl(t, s)),
             "reverse": (distill.reverse_kl(js, jt), _np_kl(s, t)),
             "jsd 0.3": (distill.generalized_jsd(js, jt, 0.3), _np_jsd(s, t, 0.3)),
             "jsd 0.9": (distill.generalized_jsd(js, jt, 0.9), _np_jsd(s, t, 0.9)),
             # the ends of beta: the KLs the divergence interpolates between
             "jsd 0": (distill.generalized_jsd(js, jt, 0.0), _np_kl(t, s)),
             "jsd 1": (distill.generalized_jsd(js, jt, 1.0), _np_kl(s, t)),
             "top-5": (distill.top_k_reverse_kl(js, jt, 5), _np_top_k_reverse(s, t, 5)),
             "top-all": (distill.top_k_reverse_kl(js, jt, 40), _np_kl(s, t))}
    for name, (got, want) in cases.items():
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6, err_msg=name)
    assert (np.asarray(cases["jsd 0.3"][0]) > 0).all()
    assert distill.DIVERGENCES.missing() == []


def test_divergence_gradients_are_the_definitions_gradients(logits):
    """The closed-form gradients in the student's logits equal autodiff of the plain
    definitions (the same transcriptions in jnp)."""
    zs, zt = (jnp.asarray(z, jnp.float32) for z in logits)
    ls = lambda z: jax.nn.log_softmax(z, -1)  # noqa: E731

    def kl(p, q):
        return (jnp.exp(p) * (p - q)).sum(-1)

    def jsd(s, t, beta):
        m = jnp.log(beta * jnp.exp(t) + (1 - beta) * jnp.exp(s))
        return beta * kl(t, m) + (1 - beta) * kl(s, m)

    def top5(s, t):
        keep = s >= jax.lax.stop_gradient(jax.lax.top_k(s, 5)[0][..., -1:])
        rs = ls(jnp.where(keep, s, -1e30))
        rt = ls(jnp.where(keep, t, -1e30))
        return jnp.where(keep, jnp.exp(rs) * (rs - rt), 0.0).sum(-1)

    pairs = {"forward": (distill.forward_kl, lambda s, t: kl(t, s)),
             "reverse": (distill.reverse_kl, kl),
             "jsd": (lambda s, t: distill.generalized_jsd(s, t, 0.3), lambda s, t: jsd(s, t, 0.3)),
             "top-5": (lambda s, t: distill.top_k_reverse_kl(s, t, 5), top5)}
    weights = jnp.asarray(np.random.default_rng(2).normal(0, 1, zs.shape[:-1]), jnp.float32)
    for name, (ours, plain) in pairs.items():
        got = jax.grad(lambda z: (ours(ls(z), ls(zt)) * weights).sum())(zs)
        want = jax.grad(lambda z: (plain(ls(z), ls(zt)) * weights).sum())(zs)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_chunked_pair_head_equals_the_whole_vocabulary_and_its_gradient():
    """Two linear heads of different widths (student D=8, teacher E=12) over V=40: the
    chunked divergence and its gradient in the student's weights and states equal those
    from the whole B x T x V logits; the teacher gets no gradient."""
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.normal(0, 1, shape), jnp.float32)  # noqa: E731
    ws, wt = normal(40, 8), normal(40, 12)
    hs, ht = normal(2, 7, 8), normal(2, 7, 12)
    targets = jnp.asarray(rng.integers(0, 40, (2, 7)), jnp.int32)
    head = lambda w, h: h @ w.T  # noqa: E731

    def stats(pair, tgt):
        s, t = (jax.nn.log_softmax(z, -1) for z in pair)
        return distill.reverse_kl(s, t), distill.generalized_jsd(s, t, 0.4)

    def whole(w, h, wt):
        return stats((head(w, h), head(wt, ht)), targets)

    def chunked(w, h, wt, size):
        return chunked_pair_head(head, w, h, head, wt, ht, targets, stats, chunk_size=size)

    want = whole(ws, hs, wt)
    for size in (3, 5, 100):
        got = chunked(ws, hs, wt, size)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda w, h, wt: sum(x.sum() for x in f(w, h, wt))  # noqa: E731
    g_want = jax.grad(loss(whole), argnums=(0, 1, 2))(ws, hs, wt)
    g_got = jax.grad(loss(lambda w, h, wt: chunked(w, h, wt, 5)), argnums=(0, 1, 2))(ws, hs, wt)
    for g, w in zip(g_got[:2], g_want[:2]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(g_got[2]).max()) == 0.0  # the teacher is a constant


# ---------------------------------------------------------------- runs on the tiny model

STUDENT = dict(TINY_MODEL, tokenizer="bytes")


def _config(tmp_path: Path, name: str, teacher: Path, steps: int = 1, model=None, mesh=None,
            optim=None, **algo):
    common = dict(model=model or STUDENT, mesh=mesh or {}, logger={"progress": False},
                  optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant", **(optim or {})},
                  run={"dir": str(tmp_path / f"run-{name}-{len(algo)}")})
    if name == "kd":
        return make_config(algo={"name": "kd", "teacher": str(teacher), **algo},
                           data={"name": "arithmetic", "num_train": 64, "num_eval": 16,
                                 "max_len": 16},
                           train={"steps": steps, "batch_size": 8, "eval_every": 0,
                                  "checkpoint_every": 0, "eval_batch_size": 16}, **common)
    return make_config(algo={"name": "opd", "num_generations": 4, "teacher": str(teacher), **algo},
                       data={"name": "arithmetic", "num_train": 64, "num_eval": 8, "max_len": 16},
                       train={"steps": steps, "batch_size": 4, "eval_every": 0,
                              "checkpoint_every": 0, "eval_batch_size": 8, "eval_pass_k": 1},
                       rollout={"max_new_tokens": 6, "temperature": 1.0}, **common)


@pytest.fixture(scope="module")
def own_teacher(tmp_path_factory) -> Path:
    """An HF directory holding the student's own initial weights (tiny, seed 3)."""
    return tiny_teacher(tmp_path_factory.mktemp("own") / "teacher", STUDENT, seed=3)


VARIANTS = {
    "opd sampled": ("opd", {}, {}),
    "opd full": ("opd", {"signal": "full"}, {}),
    "opd full top-k, packed off": ("opd", {"signal": "full", "top_k": 7}, {}),
    "opd sampled, LoRA student": ("opd", {}, {"lora": {"rank": 4}}),
    "kd forward": ("kd", {}, {}),
    "kd reverse": ("kd", {"divergence": "reverse_kl"}, {}),
    "kd jsd": ("kd", {"divergence": "jsd", "jsd_beta": 0.3}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_student_that_is_its_teacher_gets_no_signal_and_no_update(tmp_path, own_teacher, variant):
    """Student = teacher (the same weights, loaded from the teacher's directory): every
    variant's divergence and gradient are exactly zero and a step leaves the parameters
    bit for bit as they were (no task reward, no weight decay)."""
    from gpurl.config import LoraConfig
    from gpurl.train.loop import build

    name, algo, extra = VARIANTS[variant]
    model = dict(STUDENT, checkpoint=str(own_teacher), init="checkpoint")
    if "lora" in extra:
        model["lora"] = LoraConfig(rank=4)
    cfg = _config(tmp_path, name, own_teacher, model=model, **algo)
    if "packed off" in variant:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, packed=False))
    _, setup, stepper = build(cfg)
    state = setup.init()
    before = jax.device_get(state.params)
    state, metrics = stepper.step(state, 0)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()
               if not callable(getattr(v, "observe", None))}
    kl = [v for k, v in metrics.items() if k.startswith("distill/")]
    assert kl == [0.0], metrics
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_teacher_is_sharded_like_the_student_and_counted_by_the_plan(tmp_path):
    """A teacher twice the student's width over fsdp=4: each device holds a quarter of
    each large matrix (not a replica), and the train step's plan has a `teacher` part of
    that size."""
    from gpurl.train.loop import build
    from gpurl.train.fitting import memory_plan

    wide = dict(STUDENT, d_model=64, mlp_dim=128, head_dim=16)
    teacher = tiny_teacher(tmp_path / "wide", wide, seed=1)
    cfg = _config(tmp_path, "kd", teacher, mesh={"data": 1, "fsdp": 4})
    cfg, setup, stepper = build(cfg)
    embed = setup.teacher.abstract.params["embed"]
    assert embed.shape == (259, 64) and embed.sharding.shard_shape(embed.shape)[1] == 16
    plans = memory_plan(cfg, setup, stepper)
    part = plans[0].parts["teacher"]
    assert part == setup.teacher.bytes_per_device()
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.teacher.abstract.params))
    assert whole / 4 <= part < whole / 2


def test_a_kl_penalty_in_the_reward_of_on_policy_distillation_is_refused():
    """algo=opd scales the rewards' group advantages by algo.task_weight (0 by default), so
    a KL penalty in the reward would vanish (or be weighed by task_weight, never by beta):
    refused in one sentence; the penalty in the loss stays available."""
    with pytest.raises(ConfigError, match=r"^algo=opd weighs the rewards' advantages by "
                                          r"algo.task_weight=0, .* or algo.beta=0\.$"):
        registry_config("opd", teacher="t", beta=0.05, kl_in_reward=True)
    registry_config("opd", teacher="t", beta=0.05, kl_in_reward=False)


def test_teacher_errors_are_one_sentence(tmp_path, own_teacher):
    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.train.loop import build

    cases = []
    missing = _config(tmp_path, "kd", own_teacher)
    cases.append((dataclasses.replace(missing, algo=dataclasses.replace(missing.algo, teacher=None)),
                  "algo.teacher is not set"))
    cases.append((_config(tmp_path, "kd", tmp_path / "nowhere"), "is not an HF safetensors"))
    bigger = tiny_teacher(tmp_path / "vocab", dict(STUDENT, vocab_size=300), seed=1)
    cases.append((_config(tmp_path, "opd", bigger), "300 vocabulary rows"))
    other = tiny_teacher(tmp_path / "tok", STUDENT, seed=1)
    tok = byte_tokenizer().tok
    vocab = tok.get_vocab(with_added_tokens=True)
    renamed = {v: k for k, v in vocab.items()}
    import json
    saved = json.loads(tok.to_str())
    saved["model"]["vocab"] = {("Z" if i == 100 else renamed[i]): i for i in range(259)
                               if renamed[i] not in ("<pad>", "<eos>", "<bos>")}
    (other / "tokenizer.json").write_text(json.dumps(saved))
    cases.append((_config(tmp_path, "kd", other), "has another tokenizer than the student"))
    for cfg, words in cases:
        with pytest.raises(ConfigError) as e:
            build(cfg)
        message = str(e.value)
        assert words in message and message.count(". ") == 0 and message.endswith("."), message


# ---------------------------------------------------------------- students learn teachers


@pytest.fixture(scope="module")
def sharp_teacher(tmp_path_factory) -> Path:
    """A tiny random teacher with peaked next-token distributions (large weights), so its
    greedy outputs are well defined and far from a fresh student's."""
    return tiny_teacher(tmp_path_factory.mktemp("sharp") / "teacher",
                        dict(STUDENT, init_std=0.5), seed=11)


def _greedy_agreement(student_spec, student_params, teacher, prompts: list[list[int]],
                      steps: int = 6) -> float:
    """The share of the teacher's greedy continuation tokens (`steps` per prompt) that the
    student's argmax predicts along the teacher's path: 1.0 means the student's greedy
    outputs are the teacher's."""
    hits = total = 0
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            tokens = jnp.asarray([seq], jnp.int32)
            pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
            seg = jnp.ones_like(tokens)
            t_next = int(jnp.argmax(teacher.spec.apply(teacher.params, tokens, pos, seg)[0, -1]))
            s_next = int(jnp.argmax(student_spec.apply(student_params, tokens, pos, seg)[0, -1]))
            hits, total = hits + (t_next == s_next), total + 1
            seq.append(t_next)
    return hits / total


UNTIED = dict(STUDENT, tie_embeddings=False)


@pytest.fixture(scope="module")
def counting_teacher(tmp_path_factory) -> Path:
    """A teacher whose greedy next token is the current one + 1 (its output head is the
    embedding shifted by one row, x 3): a peaked, context-dependent rule a fresh student
    does not follow (a fresh tied model's argmax repeats the current token)."""
    return tiny_teacher(tmp_path_factory.mktemp("count") / "teacher", UNTIED, seed=11,
                        edit=lambda p: {**p, "lm_head": 3.0 * jnp.roll(p["embed"], 1, axis=0).T})


@pytest.mark.e2e
def test_on_policy_distillation_learns_the_teachers_greedy_outputs(tmp_path, counting_teacher):
    """The full-vocabulary signal: the student samples, and after 40 steps its greedy
    outputs are the teacher's on the prompts it trained on. (The one-sample signal moves a
    student this far from its teacher only slowly: nearly every sampled token is one the
    teacher rejects; docs/algorithms.md says when to use which.)"""
    from gpurl.train.loop import build

    cfg = _config(tmp_path, "opd", counting_teacher, steps=40, signal="full", model=UNTIED)
    _, setup, stepper = build(cfg)
    state = setup.init()
    prompts = [list(p) for p in stepper.prompts.tokens[:8]]
    teacher = setup.frozen_teacher()
    start = _greedy_agreement(setup.spec, state.params, teacher, prompts)
    kl = []
    for step in range(cfg.train.steps):
        state, metrics = stepper.step(state, step)
        kl.append(float(metrics["distill/reverse_kl"]))
    end = _greedy_agreement(setup.spec, state.params, teacher, prompts)
    assert start < 0.2 and end >= 0.9, (start, end)
    assert np.mean(kl[-5:]) < 0.2 * np.mean(kl[:5]), kl


@pytest.mark.e2e
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_logit_distillation_lowers_the_held_out_kl_to_the_teacher(tmp_path, sharp_teacher, divergence):
    from gpurl.train.loop import build

    cfg = _config(tmp_path, "kd", sharp_teacher, steps=30, divergence=divergence)
    _, setup, stepper = build(cfg)
    state = setup.init()
    key = f"eval/distill/{divergence}"
    before = stepper.evaluate(state.params)[key]
    for step in range(cfg.train.steps):
        state, _ = stepper.step(state, step)
    after = stepper.evaluate(state.params)[key]
    assert after < 0.5 * before, (before, after)


@pytest.mark.e2e
def test_on_policy_distillation_on_multi_turn_trajectories(tmp_path, sharp_teacher):
    """The student plays guess-the-number for up to 3 turns; the teacher scores the
    student's own tokens (observations carry no signal): the run completes with the
    environment's metrics and a finite, positive distillation signal."""
    import json

    from gpurl.train.loop import train

    cfg = make_config(
        algo={"name": "opd", "num_generations": 2, "teacher": str(sharp_teacher)},
        model=STUDENT, logger={"progress": False}, run={"dir": str(tmp_path / "opd")},
        data={"name": "guess_number", "num_train": 32, "num_eval": 0, "max_len": 256, "few_shot": 1},
        optim={"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 4, "stop": ["\n"]},
        env={"name": "guess_number", "max_turns": 3, "max_tokens": 32})
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "opd/metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "env/turns" in x]
    assert len(steps) == 2
    for x in steps:
        assert np.isfinite([x["loss"], x["grad_norm"]]).all() and x["distill/reverse_kl"] > 0
        assert x["env/observation_tokens"] > 0 and 1 <= x["env/turns"] <= 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "kd"])
def test_perplexity_is_exp_of_the_unsmoothed_nll(tmp_path, own_teacher, name):
    """`eval/perplexity` is exp of the held-out tokens' mean NLL (the training forward's
    full-vocabulary log-probs), however algo.label_smoothing smooths the loss (it once
    reported exp of the smoothed loss)."""
    from gpurl.algorithms.forward import token_logprobs
    from gpurl.train.loop import build

    cfg = _config(tmp_path, "kd", own_teacher, label_smoothing=0.3, ce_weight=1.0)
    if name == "sft":
        cfg = dataclasses.replace(cfg, algo=registry_config("sft", label_smoothing=0.3))
    _, setup, stepper = build(cfg)
    params = setup.init().params
    got = stepper.evaluate(params)
    rows = stepper.evals
    batch = {"tokens": rows.tokens, "positions": rows.positions, "segment_ids": rows.segment_ids}
    logp = np.asarray(jax.jit(lambda p, b: token_logprobs(setup.spec.apply, p, b))(params, batch))
    mask = rows.loss_mask[:, 1:]
    nll = -(logp * mask).sum() / mask.sum()
    np.testing.assert_allclose(got["eval/perplexity"], np.exp(nll), rtol=1e-5)
    assert got["eval/loss"] > got["eval/nll"] + 0.05  # the smoothing binds: loss is not the NLL
