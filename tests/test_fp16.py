"""fp16 training with dynamic loss scaling (model.dtype=float16, for GPUs without bf16).

A tiny fp16 run in which one step's gradient is made to overflow (an extra loss term whose
value is 0 but whose gradient, times the loss scale, is past fp16's largest number):
exactly that update is left out, the scale halves, the step is not counted as non-finite,
the scale grows again after `optim.loss_scale_growth_every` finite steps (a transcription
of the rule, PyTorch GradScaler's), it is checkpointed with the state, and the run learns
as the same run in bf16 does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.algorithms import registry
from gpurl.algorithms.objective import Objective
from gpurl.data.batching import step_indices, take
from gpurl.data.sft import encode_sft
from gpurl.data.sources import load_examples
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import model_spec
from gpurl.models.loading import load_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.optim import make_optimizer
from gpurl.train.step import make_init, make_train_step, placement, scaling_for

# a scale that starts low and grows every 3 steps (to 2^14 at most): no natural overflow of
# this tiny model, so the injected one is the only one
STEPS, POISONED, GROWTH, INIT = 14, 5, 3, 1024.0


def _poisoned(objective: Objective) -> Objective:
    """The objective plus a term that is 0 but has gradient 1e4 per embedding entry on
    rows whose `poison` is 1: times the scale (>= 2^10) that is past fp16's 65504."""
    def loss(spec, params, batch, norm, teacher=None):
        value, metrics = objective.apply(spec, params, batch, norm, teacher)
        e16 = params["embed"].astype(jnp.float16)
        zero = (e16 - jax.lax.stop_gradient(e16)).astype(jnp.float32).sum()
        return value + jnp.max(batch["poison"]) * 1e4 * zero, metrics
    return dataclasses.replace(objective, loss=loss)


def _run(dtype: str, tmp_path=None):
    cfg = make_config(model=dict(TINY_MODEL, dtype=dtype), mesh={"data": 1},
                      data={"max_len": 24, "num_train": 64, "num_eval": 0},
                      optim={"lr": 3e-3, "warmup_steps": 0, "decay": "constant",
                             "loss_scale_init": INIT, "loss_scale_growth_every": GROWTH})
    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, STEPS)
    scaling = scaling_for(cfg.model, cfg.optim)
    place = placement(spec, optimizer, trainer_mesh(cfg.mesh, jax.devices()[:1]),
                      cfg.mesh.train_rules, scaling)
    objective = _poisoned(registry.get("sft").objective(cfg.algo, cfg.rollout))
    step = make_train_step(spec, objective, optimizer, place, 1, scaling=scaling)
    state = make_init(spec, optimizer, place, 0, scaling=scaling)()
    rows = encode_sft(load_examples(cfg.data)[0], load_tokenizer(cfg.model), cfg.data)
    history = []
    for i in range(STEPS):
        batch = take(rows, step_indices(len(rows), 8, i, seed=0))
        batch["poison"] = np.full((8,), float(i == POISONED and dtype == "float16"), np.float32)
        before = jax.device_get((state.params, state.opt_state))
        state, metrics = step(state, jax.device_put(batch, place.batch), None)
        history.append((before, jax.device_get(metrics), jax.device_get(state)))
    if tmp_path is not None:  # the scale is part of the checkpointed state
        ckpt = Checkpointer(tmp_path / "ckpt", keep=1)
        ckpt.save(STEPS, state, {})
        restored, _ = ckpt.restore(STEPS, place.abstract_state, place.state)
        ckpt.close()
        assert float(restored.loss_scale.scale) == float(state.loss_scale.scale)
        assert int(restored.loss_scale.finite_steps) == int(state.loss_scale.finite_steps)
    return history


def _expected_scales(overflows: list[bool], init: float = INIT) -> list[float]:
    """The scale each step uses: halve on overflow, double after GROWTH finite steps."""
    scales, scale, good = [], init, 0
    for overflow in overflows:
        scales.append(scale)
        if overflow:
            scale, good = max(scale / 2, 1.0), 0
        elif good + 1 >= GROWTH:
            scale, good = scale * 2, 0
        else:
            good += 1
    return scales


@pytest.mark.slow
def test_fp16_overflow_skips_that_update_halves_the_scale_and_learns_like_bf16(tmp_path):
    fp16, bf16 = _run("float16", tmp_path), _run("bfloat16")
    overflow = [bool(m["overflow"]) for _, m, _ in fp16]
    assert overflow == [i == POISONED for i in range(STEPS)]
    assert [float(m["loss_scale"]) for _, m, _ in fp16] == _expected_scales(overflow)
    assert all(float(m["nonfinite"]) == 0.0 for _, m, _ in fp16)  # an overflow is not a NaN loss
    for i, (before, _, after) in enumerate(fp16):
        same = all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(before), jax.tree.leaves((after.params, after.opt_state))))
        assert same == (i == POISONED), f"step {i}: update {'left out' if same else 'applied'}"
    assert int(fp16[-1][2].step) == STEPS  # the skipped step still counts
    assert "loss_scale" not in bf16[0][1] and bf16[0][2].loss_scale is None
    # learns like bf16: the same fall of the loss, 6.7 -> ~3.4 (fp16 took one update fewer:
    # its final loss was 5% above bf16's when measured)
    loss16 = [float(m["loss"]) for _, m, _ in fp16]
    loss_bf = [float(m["loss"]) for _, m, _ in bf16]
    assert abs(loss16[0] - loss_bf[0]) < 0.02 * loss_bf[0]
    assert loss16[-1] < 0.6 * loss16[0] and loss_bf[-1] < 0.6 * loss_bf[0]
    assert abs(loss16[-1] - loss_bf[-1]) < 0.1 * loss_bf[-1], (loss16, loss_bf)
