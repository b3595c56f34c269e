"""The context axis (`mesh.context`): packed rows whose tokens are split over devices give
the step of one device per row (fp32, 1e-5): prepared arrays, metrics and every gradient,
on rows with shared-prefix segments, sliding-window layers and completions longer than a
device's share of a row; attention per implementation against the unsplit reference."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from test_packing import (CASES, CLEN, _close, _collected, _config, _grads, _prepared,
                          pairs_batches)


@functools.cache
def _built(name: str, context: int, key: str = ""):
    from gpurl.train.loop import build

    mesh = {1: {"data": 2, "tp": 2}, 2: {"data": 2, "context": 2}, 4: {"data": 1, "context": 4}}
    over = {k: v for k, v in CASES[key].items() if k != "algo"} if key else {}
    cfg = _config(name, mesh=mesh[context], algo={"beta": 0.04}, **over)
    return build(cfg)


def _step(name: str, context: int, key: str = ""):
    cfg, setup, stepper = _built(name, context, key)
    params = setup.init().params
    collected, rewards = _collected(stepper, multi_turn=True)
    batch, metrics, m = _prepared(stepper, params, collected, rewards, packed=True)
    grads, step_metrics = _grads(setup, batch, m)
    return batch, metrics, grads, step_metrics, collected


@pytest.mark.slow
@pytest.mark.parametrize("context,key", [(2, ""), (4, ""), (2, "moe")])
def test_grpo_step_split_over_the_context_axis_equals_one_device_per_row(context, key):
    """Widths 2 and 4 of the gemma3 tiny model (sliding-window layers), and a mixture of
    experts with routing replay at width 2 (each device routes the tokens it holds)."""
    base = _step("grpo", 1, key)
    split = _step("grpo", context, key)
    assert split[0]["pack/tokens"].shape[1] // context < CLEN.max()  # a completion spans devices
    mask = np.asarray(base[4].comp_mask)
    for k in base[1]:
        _close(base[1][k], split[1][k], k)
    assert "ref_logprobs" in base[0]
    for k in ("advantages", "old_logprobs", "ref_logprobs"):
        if k not in base[0]:
            continue
        a, b = np.asarray(base[0][k]), np.asarray(split[0][k])
        if a.ndim == 3:
            a, b = a * mask, b * mask
        _close(a, b, k)
    assert set(base[3]) == set(split[3])
    for k in base[3]:
        _close(base[3][k], split[3][k], k)
    for path, a in jax.tree_util.tree_leaves_with_path(base[2]):
        b = functools.reduce(lambda t, p: t[p.key], path, split[2])
        _close(a, b, jax.tree_util.keystr(path))


def _pairs_step(context: int):
    mesh = {1: {"data": 2, "tp": 2}, 2: {"data": 2, "context": 2}}[context]
    _, setup, stepper, _, packed, m = pairs_batches("dpo", mesh)
    params = setup.init().params
    ref = stepper._logps(params, packed)[0]
    # a reference apart from the policy: margins away from 0 (accuracy is their sign)
    apart = ref + np.random.default_rng(0).normal(0, 1, ref.shape).astype(np.float32)
    return ref, _grads(setup, {**packed, "ref_logps": apart}, m)


@pytest.mark.slow
def test_dpo_pairs_split_over_the_context_axis_equal_one_device_per_row():
    (ref1, (g1, met1)), (ref2, (g2, met2)) = _pairs_step(1), _pairs_step(2)
    _close(ref1, ref2, "ref_logps")
    assert set(met1) == set(met2)
    for k in met1:
        _close(met1[k], met2[k], k)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        _close(a, b, "grad")


@pytest.mark.slow
def test_planned_activations_per_device_fall_with_the_context_width():
    """One 2,048-slot row per micro-batch (train.micro_batch_tokens=1), its tokens split
    over 1, 2 and 4 devices: the train step's activations per device (XLA's memory
    analysis of the compiled step) fall with the width."""
    from conftest import TINY_MODEL
    from gpurl.train.loop import build
    from gpurl.train.fitting import plan_train_step

    activations = {}
    for context in (1, 2, 4):
        cfg = _config("grpo", mesh={"data": 1, "fsdp": 4 // context, "context": context},
                      model=dict(TINY_MODEL, tokenizer="bytes", d_model=64, mlp_dim=256),
                      train={"batch_size": 4, "micro_batch_size": 4, "micro_batch_tokens": 1},
                      rollout={"max_new_tokens": 1500})
        _, setup, stepper = build(cfg)
        batch = stepper.batch_spec()
        assert batch["pack/tokens"].shape[1] == 2048
        plan = plan_train_step(setup.step_fn, setup.place, batch, (), 0.0, 2.0**40)
        activations[context] = plan.parts["activations / scratch"]
    assert activations[2] < 0.7 * activations[1] and activations[4] < 0.7 * activations[2], activations


def _packed_row(rng, z: int):
    """Positions and segments of one packed row of z slots: two groups, each a shared
    prefix and branches, and padding at the end."""
    from gpurl.kernels.segments import BRANCHES

    pos, seg = np.zeros(z, np.int32), np.zeros(z, np.int32)
    at = 0
    for group, (prefix, branches) in enumerate([(9, [14, 5, 11]), (3, [17, 2])], start=1):
        pos[at:at + prefix], seg[at:at + prefix] = np.arange(prefix), group * BRANCHES
        at += prefix
        for j, n in enumerate(branches, start=1):
            pos[at:at + n], seg[at:at + n] = prefix + np.arange(n), group * BRANCHES + j
            at += n
    assert at <= z
    return pos, seg


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_context_attention_equals_unsplit_attention(implementation):
    """Queries, keys and values of a packed row in the balanced order over 4 devices:
    the split attention (and its gradient) equals the unsplit reference on the natural
    order, with a sliding window and a logit soft-cap."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as Spec

    from gpurl.data.packing import balanced_order
    from gpurl.kernels.attention import Shards, attention, context_attention

    rng = np.random.default_rng(0)
    b, z, h, k, e = 2, 64, 4, 2, 8
    q = rng.normal(size=(b, z, h, e)).astype(np.float32)
    kv = rng.normal(size=(2, b, z, k, e)).astype(np.float32)
    pos, seg = _packed_row(rng, z)
    pos, seg = np.tile(pos, (b, 1)), np.tile(seg, (b, 1))
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("context",))
    order = balanced_order(z, 4)
    kw = dict(scale=e ** -0.5, softcap=30.0, window=12)

    def reference(q, k, v):
        return attention(q, k, v, pos, seg, pos, seg, contiguous=True, shared_prefix=True,
                         implementation="xla", **kw)

    def split(q, k, v):
        tokens = NamedSharding(mesh, Spec(None, "context"))
        args = [jax.lax.with_sharding_constraint(x[:, order], tokens)
                for x in (q, k, v, pos, seg, pos, seg)]
        out = context_attention(*args, implementation=implementation,
                                shards=Shards(mesh, None, None, "context"), **kw)
        return out[:, np.argsort(order)]

    def loss(fn):
        return lambda *x: (fn(*x) * np.cos(np.arange(e))).sum()

    want, got = reference(q, *kv), jax.jit(split)(q, *kv)
    _close(want, got, "output")
    g_want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, *kv)
    g_got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, *kv)
    for a, c, name in zip(g_want, g_got, "qkv"):  # keys' gradients summed back to their device
        _close(a, c, f"d{name}")


def _long_run(limit_gb: float, mesh=None, train=None):
    """A packed GRPO run of long completions on a device of `limit_gb`."""
    from conftest import TINY_MODEL, make_config

    train = {"steps": 1, "batch_size": 4, "micro_batch_size": 4, "eval_every": 0,
             "checkpoint_every": 0, "eval_batch_size": 4, **(train or {})}
    return make_config(
        algo={"name": "grpo", "num_generations": 4},
        model=dict(TINY_MODEL, tokenizer="bytes", d_model=64, mlp_dim=256, num_heads=4,
                   num_kv_heads=4, head_dim=32),
        data={"name": "arithmetic", "num_train": 64, "num_eval": 0, "max_len": 16},
        train=train, rollout={"max_new_tokens": 2000, "slots": 64},
        mesh=mesh or {"data": 2, "context": 2}, plan={"device_memory_gb": limit_gb},
        logger={"progress": False})


def _planned(limit_gb: float, mesh=None, train=None):
    """(config, stepper, plans by name) of `_long_run`, built and planned as `gpurl train`
    does (`fitted`: mesh.context=auto resolved)."""
    from gpurl.train.loop import build
    from gpurl.train.fitting import fitted

    cfg, _, stepper, plans = fitted(_long_run(limit_gb, mesh, train), build)
    return cfg, stepper, {p.name: p for p in plans}


@pytest.mark.slow
def test_context_auto_picks_the_narrowest_width_whose_train_step_fits():
    """mesh.context=auto (the default; 1 where the train step fits, as every other plan in
    the suite shows): on a device where one row per micro-batch does not fit at width 1
    but does at 2, width 2, its devices taken from the data axis (fsdp is 1), said in the
    plan; the run then trains on that mesh."""
    from gpurl.train.loop import build
    from gpurl.train.fitting import _train_plan

    one_row = {}  # the train step's total with one row per micro-batch, by width
    for width, mesh in ((1, {"data": 4, "context": 1}), (2, {"data": 2, "context": 2})):
        run = _long_run(100.0, mesh, train={"micro_batch_tokens": 1})
        one_row[width] = _train_plan(*build(run)).total
    assert one_row[2] < one_row[1], one_row
    limit = (one_row[1] + one_row[2]) / 2
    cfg, stepper, tight = _planned(limit / 2**30, mesh={"data": 4})
    train = tight["train step"]
    assert train.fits, train.table()
    assert (cfg.mesh.context_width, cfg.mesh.data, cfg.mesh.fsdp) == (2, 2, 1), cfg.mesh
    assert stepper.context == 2 and dict(stepper.setup.place.mesh.shape)["context"] == 2
    assert train.chosen[0].startswith("mesh.context=auto -> 2 with mesh.fsdp=1 mesh.data=2"), (
        train.chosen)


@pytest.mark.slow
def test_the_plan_lowers_the_token_budget_and_caps_the_kv_pool_until_both_fit():
    """train.micro_batch_tokens=0 and rollout.kv_cache_tokens=0 (auto): with room for
    everything they keep the padded micro-batch's budget and a pool for every slot; on a
    device too small for those, the plan picks the largest budget and pool that fit, says
    so, and the run then uses them; where even one row does not fit, the advice names a
    wider context axis."""
    from gpurl.plan.memory import advice

    _, stepper, roomy = _planned(100.0)
    budget = stepper.budget
    act = roomy["train step"].parts["activations / scratch"]
    assert not roomy["train step"].chosen and not roomy["rollout"].chosen
    # a device with room for about a third of the default micro-batch's activations
    _, stepper, tight = _planned((roomy["train step"].total - 0.6 * act) / 2**30)
    train = tight["train step"]
    assert train.fits and stepper.budget < budget, (stepper.budget, budget)
    assert "train.micro_batch_tokens=0 (auto) ->" in train.chosen[0]
    # a device too small for even one row per micro-batch: the advice names a wider
    # context axis, not the token budget the plan already lowered to one row
    cfg, _, hopeless = _planned(0.05 * roomy["train step"].total / 2**30)
    train = hopeless["train step"]
    assert not train.fits and train.micro_rows == 1
    text = advice(cfg, train)
    assert "mesh.context=4" in text and "train.micro_batch_tokens=1" not in text, text
    # many rows of long completions (32 prompts x 4): the pool outgrows a small device
    _, stepper, roomy = _planned(100.0, train={"batch_size": 32, "micro_batch_size": 32,
                                            "micro_batch_tokens": 1})
    rollout = roomy["rollout"]
    assert rollout.largest()[0] == "KV cache"
    limit = roomy["train step"].total + 0.5 * (rollout.total - roomy["train step"].total)
    _, stepper, tight = _planned(limit / 2**30, train={"batch_size": 32, "micro_batch_size": 32,
                                                    "micro_batch_tokens": 1})
    rollout = tight["rollout"]
    assert rollout.fits, rollout.table()
    assert "rollout.kv_cache_tokens=0 (auto) ->" in rollout.chosen[0]
    cap = stepper.engine.cfg.kv_cache_tokens  # what the run's scheduler will use
    assert f"{cap:,} tokens per rollout data shard" in rollout.chosen[0]
    assert rollout.request_tokens <= cap and rollout.kv_tokens < roomy["rollout"].kv_tokens


def _rows_step(name: str, context: int, teacher=None):
    from conftest import TINY_MODEL, make_config
    from gpurl.data.batching import step_indices, take
    from gpurl.train.loop import build

    mesh = {1: {"data": 2, "tp": 2}, 2: {"data": 2, "context": 2}}[context]
    algo = {"name": name, **({"teacher": str(teacher)} if teacher else {})}
    cfg = make_config(
        algo=algo, model=dict(TINY_MODEL, tokenizer="bytes", family="gemma3", sliding_window=6,
                              global_every=2),
        data={"name": "arithmetic", "num_train": 64, "num_eval": 0, "max_len": 30,
              "packing": True},
        train={"steps": 1, "batch_size": 8, "micro_batch_size": 4, "eval_every": 0,
               "checkpoint_every": 0, "eval_batch_size": 8},
        mesh=mesh, logger={"progress": False})
    cfg, setup, stepper = build(cfg)
    rows = take(stepper.rows, step_indices(len(stepper.rows), 8, 0, 0))
    batch = setup.to_global(stepper._laid_out(rows))
    from gpurl.train.step import accumulate_grads

    teacher_params = setup.frozen_teacher()
    fn = jax.jit(lambda p, b, t: accumulate_grads(setup.spec, setup.objective, setup.place,
                                                  cfg.train.num_micro_batches, p, b,
                                                  teacher=t))
    return fn(setup.init().params, batch, teacher_params)


@pytest.mark.slow
def test_sft_and_logit_distillation_rows_split_over_the_context_axis_equal_unsplit(tmp_path):
    """SFT's packed token rows (several examples per row, sliding-window layers) and
    logit distillation from a teacher, split over a context axis of 2: the loss, every
    metric and every gradient equal the unsplit step's."""
    from conftest import TINY_MODEL, tiny_teacher

    teacher = tiny_teacher(tmp_path / "teacher", dict(TINY_MODEL, tokenizer="bytes"), seed=1)
    for name, kw in (("sft", {}), ("kd", {"teacher": teacher})):
        (g1, m1), (g2, m2) = _rows_step(name, 1, **kw), _rows_step(name, 2, **kw)
        assert set(m1) == set(m2)
        for k in m1:
            _close(m1[k], m2[k], f"{name} {k}")
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            _close(a, b, f"{name} grad")
