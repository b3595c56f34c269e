"""Pieces of the RL step on constructed inputs: DAPO's overlong shaping and dynamic
sampling, and the prompt + completion sequences the trainer sees."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from gpurl.train.rl import RLStepper, overlong_penalty, select_groups


def dapo_overlong_reference(length: int, l_max: int, l_cache: int) -> float:
    """Yu et al. 2025 (DAPO), eq. 13, transcribed case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if l_max - l_cache < length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_matches_dapo_eq13():
    lengths = np.arange(0, 21)
    got = overlong_penalty(lengths, max_tokens=20, buffer=8, factor=1.0)
    want = [dapo_overlong_reference(n, 20, 8) for n in lengths]
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert got[12] == 0.0 and got[20] == -1.0 and got[16] == -0.5
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 8, 0.5), np.asarray(want) * 0.5)
    # Off when disabled, or when the buffer is not shorter than the limit.
    assert not overlong_penalty(lengths, 20, 0, 1.0).any()
    assert not overlong_penalty(lengths, 20, 20, 1.0).any()


def test_dynamic_sampling_drops_groups_with_equal_rewards():
    rewards = np.asarray([1, 1, 1, 1,   0, 1, 0, 0,   0, 0, 0, 0,   0.5, 0.5, 0.5, 0.25],
                         np.float32)
    keep, drop = select_groups(rewards, group=4, wanted=4, drop_equal=True)
    assert keep.tolist() == [1, 3] and drop.tolist() == [0, 2]
    keep, drop = select_groups(rewards, group=4, wanted=4, drop_equal=False)
    assert keep.tolist() == [0, 1, 2, 3] and drop.tolist() == []


def test_sequences_put_each_completion_right_after_its_prompt():
    pad = 0
    fake = SimpleNamespace(tokenizer=SimpleNamespace(pad_id=pad))
    prompt_BxP = jnp.asarray([[5, 6, 7, pad], [8, 9, pad, pad], [3, pad, pad, pad]])
    plen_B = jnp.asarray([3, 2, 1])
    comp_BxN = jnp.asarray([[11, 12, pad], [13, pad, pad], [14, 15, 16]])
    clen_B = jnp.asarray([2, 1, 3])
    clp_BxN = jnp.asarray([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-4.0, -5.0, -6.0]])
    select_K = jnp.asarray([2, 0])  # rows in a new order
    keep_K = jnp.asarray([True, False])
    out = RLStepper._assemble_fn(fake, [(prompt_BxP, plen_B, comp_BxN, clen_B, clp_BxN)],
                                 select_K, keep_K)
    np.testing.assert_array_equal(out["tokens"], [[3, 14, 15, 16, 0, 0, 0],
                                                  [5, 6, 7, 11, 12, 0, 0]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 1, 0, 0, 0],
                                                       [1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(out["positions"][1], np.arange(7))
    np.testing.assert_array_equal(out["completion_start"], [1, 3])
    # Loss on real completion tokens only, and none on a filler group (keep False).
    np.testing.assert_array_equal(out["comp_mask"], [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(out["sampler_logprobs"], [[-4, -5, -6], [-1, -2, 0]])
