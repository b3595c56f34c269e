"""Packed RL training (`gpurl.data.packing`): the plan places every token once, and every
pass of the step on packed rows equals the padded step (fp32, 1e-5): prepared arrays,
metrics and gradients, for each family, on batches with a long tail of lengths, empty
completions, a completion longer than the token budget's row, and multi-turn masks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.data import packing
from gpurl.data.rollouts import RolloutBatch
from gpurl.kernels.segments import BRANCHES
from gpurl.config import LoraConfig, MoEConfig

P, G, N = 4, 4, 40
# a long tail (most short, one at the limit), empty completions, one that fills a row alone
CLEN = np.asarray([[40, 3, 0, 5], [1, 1, 2, 30], [7, 0, 3, 3], [12, 25, 2, 1]])


# ---------------------------------------------------------------- the plan (numpy)

def _check_plan(pl: packing.Plan, plen, clen, width, n):
    """Every prompt prefix and completion token sits in its row as the docstring says, in
    the stored order of the plan's context blocks (`balanced_order`)."""
    p, g = clen.shape
    rows, length = pl.shape
    order = packing.balanced_order(length, pl.context)
    stored_of = np.argsort(order)
    assert sorted(order.tolist()) == list(range(length))
    source, positions, segments = (x[:, stored_of] for x in (pl.source, pl.positions, pl.segments))
    seen = np.zeros(p * width + p * g * n, int)
    src = source[source >= 0]
    np.add.at(seen, src, 1)
    _, blocks, h = pl.head.shape
    assert blocks == pl.context
    for q in range(p):
        for c in range(g):
            row = pl.row[q, c]
            at = order[pl.state_cols[q, c, 0]]  # s_0's natural slot
            np.testing.assert_array_equal(pl.state_cols[q, c, :clen[q, c] + 1],
                                          stored_of[at + np.arange(clen[q, c] + 1)])
            seg = segments[row, at]
            assert seg % BRANCHES > 0  # a branch
            span = slice(at, at + clen[q, c] + 1)
            assert (segments[row, span] == seg).all()
            np.testing.assert_array_equal(positions[row, span], plen[q] - 1 + np.arange(clen[q, c] + 1))
            assert source[row, at] == q * width + plen[q] - 1  # the prompt's last token
            comp = p * width + (q * g + c) * n
            np.testing.assert_array_equal(source[row, at + 1:span.stop], comp + np.arange(clen[q, c]))
            # the prefix of its group in the row: prompt tokens 0..plen-2 at positions 0..
            prefix = (segments[row] == seg - seg % BRANCHES)
            np.testing.assert_array_equal(source[row][prefix], q * width + np.arange(plen[q] - 1))
            # the head column of token j holds (in its context block, as a local index)
            # the slot of s_j, and predicts token j
            cols = pl.head_cols[q, c, :clen[q, c]]
            block, local = cols // h, pl.head.reshape(rows, -1)[row, cols]
            np.testing.assert_array_equal(block * (length // pl.context) + local,
                                          pl.state_cols[q, c, :clen[q, c]])
            np.testing.assert_array_equal(pl.head_source.reshape(rows, -1)[row, cols],
                                          comp + np.arange(clen[q, c]))
    # every completion token exactly once; a prompt token once per row its group is in
    assert (seen[p * width:].reshape(p, g, n) == (np.arange(n) < clen[..., None])).all()


def test_balanced_order_gives_each_device_chunks_c_and_2C_minus_1_minus_c():
    np.testing.assert_array_equal(packing.balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(packing.balanced_order(8, 1), np.arange(8))
    for c in (2, 4, 8):  # every device has the same causal work: sum of (slot + 1) per block
        work = (packing.balanced_order(64, c) + 1).reshape(c, -1).sum(1)
        assert (work == work[0]).all()


def test_plan_places_every_token_once_behind_its_prompt():
    rng = np.random.default_rng(0)
    for trial in range(30):
        p, g, n, width = rng.integers(1, 6), rng.integers(1, 9), rng.integers(1, 80), 12
        plen = rng.integers(1, width + 1, p)
        clen = np.minimum(rng.geometric(0.15, (p, g)) - 1, n)
        budget, shards = int(rng.integers(16, 400)), int(rng.choice([1, 2, 4]))
        context = int(rng.choice([1, 2, 4]))
        pl = packing.plan(plen, clen, width, n, budget, shards, attention_cost=1 / 384,
                          context=context)
        rows, length = pl.shape
        assert length >= (plen[:, None] + clen).max() and rows % (shards * pl.num_micro) == 0
        assert pl.num_micro == packing.num_micro(rows, length, budget, shards, context)
        # micro-batches never exceed the budget per device unless one row's share is more
        local = length // context
        assert rows // (shards * pl.num_micro) * local <= max(budget, local)
        _check_plan(pl, plen, clen, width, n)


def test_first_fit_decreasing_fills_rows_and_the_long_tail_costs_little():
    """The issue's long-tail mix: 8 prompts of 32 tokens x G = 8; 48 completions of 32
    tokens, 12 of 128, 4 of 512. Padded: 64 x 512 completion slots for 5,120 tokens."""
    rng = np.random.default_rng(1)
    lengths = rng.permutation(np.repeat([32, 128, 512], [48, 12, 4])).reshape(8, 8)
    plen = np.full(8, 32)
    pl = packing.plan(plen, lengths, 32, 512, budget=64 * 544, shards=1, attention_cost=1 / (12 * 640))
    rows, length = pl.shape
    useful = lengths.sum() + plen.sum()
    assert rows * length <= 1.15 * useful, (rows, length, useful)
    assert pl.num_micro == 1


def test_a_completion_longer_than_the_budgets_row_gets_a_row_of_its_own_length():
    plen, clen = np.asarray([5, 3]), np.asarray([[300, 2], [4, 1]])
    pl = packing.plan(plen, clen, 8, 300, budget=64, shards=2)
    rows, length = pl.shape
    assert length >= 305 and pl.num_micro >= 1
    _check_plan(pl, plen, clen, 8, 300)


def test_groups_of_1024_completions_and_more_keep_their_own_prefix():
    """Segment ids are group x BRANCHES + branch (1024): a group's 1024th completion once
    took the id of the next group's prefix. A group of BRANCHES completions or more is
    split into chunks of at most BRANCHES - 1, each behind its own copy of the prefix."""
    for g in (BRANCHES - 1, BRANCHES, BRANCHES + 100):
        plen, clen = np.asarray([3, 4]), np.full((2, g), 1)
        # rows as long as a whole group: nothing but the branch count splits it
        pl = packing.plan(plen, clen, 4, 1, budget=1 << 16, shards=1, whole_groups=True)
        _check_plan(pl, plen, clen, 4, 1)
        rows = [set(r[r % BRANCHES > 0].tolist()) for r in pl.segments]
        assert sum(len(r) for r in rows) == 2 * g  # one branch id per completion


def test_row_shapes_stay_few_over_random_length_mixes():
    """20 steps of random heavy-tailed mixes (Pareto lengths, 1 to 512 tokens) compile few
    train-step shapes (R, L, H, M): row counts from the three-bit buckets, two row lengths."""
    rng = np.random.default_rng(2)
    shapes = set()
    for _ in range(20):
        lengths = np.minimum(rng.pareto(1.2, (8, 8)) * 20 + 1, 512).astype(int)
        pl = packing.plan(np.full(8, 32), lengths, 32, 512, budget=64 * 544, shards=1,
                          attention_cost=1 / (12 * 640))
        shapes.add((*pl.shape, pl.head.shape[2], pl.num_micro))
    assert len(shapes) <= 10 and len({s[1] for s in shapes}) <= 2, shapes


def test_bucket_and_micro_layout():
    assert [packing.bucket(n) for n in (1, 8, 9, 10, 11, 17, 100, 1000)] == [1, 8, 10, 10, 12, 20, 112, 1024]
    for rows in range(1, 200):
        for budget in (64, 500, 5000):
            r, m = packing.micro_layout(rows, 128, budget, 2)
            assert 2 * r * m >= rows and r <= max(budget // 128, 1)
            assert packing.num_micro(2 * r * m, 128, budget, 2) == m


# ---------------------------------------------------------------- packed == padded, per family

def _config(name: str, **over):
    model = over.pop("model", dict(TINY_MODEL, family="gemma3", sliding_window=6,
                                   global_every=2, tokenizer="bytes"))
    train = {"steps": 1, "batch_size": P, "micro_batch_size": 2, "eval_every": 0,
             "checkpoint_every": 0, "micro_batch_tokens": 48, "eval_batch_size": 4, **over.pop("train", {})}
    return make_config(
        algo={"name": name, "num_generations": G, **over.pop("algo", {})}, model=model,
        data={"name": "arithmetic", "num_train": 16, "num_eval": 0, "max_len": 16},
        train=train, rollout={"max_new_tokens": N, **over.pop("rollout", {})},
        logger={"progress": False},
        mesh=over.pop("mesh", {"data": 2, "tp": 2}),
        rewards=["test_grpo:printable"], **over)


@functools.cache
def _built(name: str, key: str = ""):
    from gpurl.train.loop import build

    return build(_config(name, **CASES[key or name]))


# grpo and ppo sample at temperature 0.01 (log-probs scaled by 100), with a KL term and two
# passes: a micro-batch's slots of other micro-batches' completions once overflowed exp()
# in the ratio and the k3 KL, and inf x 0 made the loss and every gradient NaN.
COLD = {"temperature": 0.01}
CASES = {
    "grpo": {"algo": {"beta": 0.04, "num_iterations": 2}, "rollout": COLD},
    "gspo": {},
    "drgrpo": {},
    "dapo": {},
    "rloo": {"algo": {"tis_cap": 2.0}},
    "ppo": {"algo": {"beta": 0.04, "kl_in_reward": True, "num_iterations": 2}, "rollout": COLD},
    "lora": {"model": dict(TINY_MODEL, tokenizer="bytes",
                           lora=LoraConfig(rank=4, alpha=8.0)), "algo": {"beta": 0.04}},
    "moe": {"model": dict(TINY_MODEL, tokenizer="bytes", family="qwen3_moe", qk_norm=True,
                          norm_plus_one=False, scale_embeddings=False, activation="silu",
                          moe=MoEConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=16,
                                        replay_routing=True, aux_loss_coef=0.0))},
}


def _collected(stepper, multi_turn: bool, seed: int = 0) -> tuple[RolloutBatch, jax.Array]:
    """A grouped batch as the collector hands it over (CLEN's lengths; multi-turn: each
    completion's middle third is an observation span, masked), and the rows' rewards."""
    rng = np.random.default_rng(seed)
    w = stepper.rounds.prompt_width
    plen = rng.integers(1, w + 1, P)
    real = np.arange(N) < CLEN[..., None]
    mask = real.copy()
    if multi_turn:
        obs = (np.arange(N) >= CLEN[..., None] // 3) & (np.arange(N) < 2 * CLEN[..., None] // 3)
        mask &= ~obs
    batch = {"prompt_tokens": np.where(np.arange(w) < plen[:, None], rng.integers(3, 250, (P, w)), 0),
             "prompt_lengths": plen, "completions": np.where(real, rng.integers(3, 250, (P, G, N)), 0),
             "completion_lengths": CLEN, "comp_mask": mask.astype(np.float32),
             "sampler_logprobs": np.where(real, -rng.uniform(0.5, 4.0, (P, G, N)), 0.0)}
    replayed = stepper.engine.routes_shape
    if replayed is not None:
        routes = rng.integers(0, 4, (P, G, N, *replayed))
        batch["routes"] = np.where(real[..., None, None], routes, -1).astype(np.int16)
    dtypes = {"comp_mask": np.float32, "sampler_logprobs": np.float32, "routes": np.int16}
    sh = stepper.setup.place.batch
    out = {k: jax.device_put(np.asarray(v, dtypes.get(k, np.int32)), sh) for k, v in batch.items()}
    return RolloutBatch(**out), jax.device_put(jnp.asarray(rng.uniform(0, 1, P * G), jnp.float32), sh)


def _prepared(stepper, params, collected, rewards, packed: bool):
    arrays = None
    if packed:
        plan = stepper._pack(collected)
        arrays = packing.put(plan, stepper.setup.place.batch)
        m = plan.num_micro
    else:
        m = stepper.train.num_micro_batches
    batch, metrics, _ = stepper._prepare(params, *stepper.frozen.values(),
                                         collected, arrays, rewards, stepper.carry)
    return batch, metrics, m


def _grads(setup, batch, m):
    from gpurl.train.step import accumulate_grads

    fn = jax.jit(lambda p, b: accumulate_grads(setup.spec, setup.objective, setup.place, m, p, b))
    return fn(setup.init().params, batch)


def _close(a, b, what, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(a).max(initial=0.0), 1.0)
    assert np.abs(a - b).max(initial=0.0) <= tol * scale, (what, np.abs(a - b).max(), scale)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_packed_step_equals_padded_step(key):
    name = {"lora": "grpo", "moe": "grpo"}.get(key, key)
    cfg, setup, stepper = _built(name, key)
    # fp32 rounding of the logits grows by 1 / temperature in the log-probs and gradients
    tol = 1e-5 / cfg.rollout.temperature
    params = setup.init().params
    for multi_turn in (False, True):
        collected, rewards = _collected(stepper, multi_turn)
        padded, m_pad, m_pack = None, None, None
        padded, pad_metrics, m_pad = _prepared(stepper, params, collected, rewards, False)
        packed, pack_metrics, m_pack = _prepared(stepper, params, collected, rewards, True)
        assert m_pack > 1  # the token budget split the packed batch into micro-batches
        assert set(pad_metrics) == set(pack_metrics)
        for k in pad_metrics:
            _close(pad_metrics[k], pack_metrics[k], k, tol)
        mask = np.asarray(collected.comp_mask)
        for k in ("advantages", "old_logprobs", "ref_logprobs", "values", "returns", "is_weights"):
            if k in padded:
                a, b = np.asarray(padded[k]), np.asarray(packed[k])
                if a.ndim == 3:
                    a, b = a * mask, b * mask
                _close(a, b, k, tol)
        g_pad, met_pad = _grads(setup, padded, m_pad)
        g_pack, met_pack = _grads(setup, packed, m_pack)
        for k, v in {**met_pack, **{f"grad {i}": g for i, g in enumerate(jax.tree.leaves(g_pack))}}.items():
            assert np.isfinite(np.asarray(v)).all(), (k, "not finite in the packed step")
        assert set(met_pad) == set(met_pack)
        for k in met_pad:
            # The router's statistics (load balance, z-loss, replay flips) are means over
            # the tokens of each micro-batch's forward pass, which the layouts group
            # differently (the padded step's change with micro_batch_size too); with
            # their coefficients 0 (RL's default) they leave the gradient alone.
            if not k.startswith("moe/"):
                _close(met_pad[k], met_pack[k], k, tol)
        for path, a in jax.tree_util.tree_leaves_with_path(g_pad):
            b = functools.reduce(lambda t, p: t[p.key], path, g_pack)
            _close(a, b, jax.tree_util.keystr(path), tol)


def pairs_batches(name: str, mesh: dict):
    """(config, setup, stepper, the padded pair batch, the packed one, its micro-batches)
    of a preference run on 8 pairs of the tiny model, token budget 40 per micro-batch."""
    from gpurl.data.batching import step_indices
    from gpurl.train.loop import build

    cfg = make_config(
        algo={"name": name}, model=dict(TINY_MODEL, tokenizer="bytes"), mesh=mesh,
        data={"name": "arithmetic_prefs", "num_train": 32, "num_eval": 0, "max_len": 32},
        train={"steps": 1, "batch_size": 8, "micro_batch_size": 4, "eval_every": 0,
               "checkpoint_every": 0, "eval_batch_size": 4, "micro_batch_tokens": 40},
        logger={"progress": False})
    cfg, setup, stepper = build(cfg)
    indices = step_indices(len(stepper.train), 8, 0, 0)
    padded = stepper._pairs(stepper.train, indices)
    packed, (m,) = stepper._pack(dict(padded), indices)
    return cfg, setup, stepper, padded, packed, m


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "simpo", "orpo", "rm"])
def test_packed_pairs_equal_padded_pairs(name):
    """Preference pairs: chosen and rejected share their prompt in one row; the loss,
    its metrics and the gradients equal the padded batch's, over token-budget
    micro-batches (a pair never split across them)."""
    cfg, setup, stepper, padded, packed, m = pairs_batches(name, {"data": 2, "tp": 2})
    params = setup.init().params
    assert m > 1
    if stepper.reference:
        ref = stepper._logps(params, padded)[0]
        _close(ref, stepper._logps(params, packed)[0], "ref_logps")
        padded, packed = {**padded, "ref_logps": ref}, {**packed, "ref_logps": ref}
    g_pad, met_pad = _grads(setup, padded, cfg.train.num_micro_batches)
    g_pack, met_pack = _grads(setup, packed, m)
    assert set(met_pad) == set(met_pack)
    for k in met_pad:
        _close(met_pad[k], met_pack[k], k)
    for a, b in zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)):
        _close(a, b, "grad")
