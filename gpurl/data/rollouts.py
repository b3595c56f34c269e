"""The rollout batch: a step's completions grouped by prompt, as the batch sources hand them
to the RL step (`gpurl.rollout.collect.Collector` builds it, on the trainer mesh). Every
array leads with the P prompts, so micro-batches and shards split whole groups of G
completions; W is the prompt width, N the completion width.

The RL step's prepare program turns it into the trainer batch (`arrays`, plus the packed
layout's arrays, `gpurl.data.packing`, when train.packed) that the algorithms' prepare
functions and losses read by key.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RolloutBatch:
    """P prompts x G completions of N tokens."""

    prompt_tokens: jax.Array  # P x W int32: each prompt left-aligned, padded after it
    prompt_lengths: jax.Array  # P int32
    completions: jax.Array  # P x G x N int32: sampled tokens, pad after the stop
    completion_lengths: jax.Array  # P x G int32: tokens generated, the stop token included
    # P x G x N float32: 1 on the tokens that carry loss (the model's own tokens of a kept
    # group; not a multi-turn trajectory's observations, not dynamic sampling's fillers)
    comp_mask: jax.Array
    sampler_logprobs: jax.Array  # P x G x N float32: the sampler's log-prob of each token, 0 after
    # P x G x N x L x k int16: the experts the sampler routed each token to (routing
    # replay of a mixture of experts); None without replay
    routes: jax.Array | None = None
    # P x M x 3 x H x W float32: a vision-language model's prompts' images, in the order
    # their image tokens come (slots past a prompt's images are zeros, never read)
    prompt_pixels: jax.Array | None = None

    @classmethod
    def spec(cls, prompts: int, group: int, width: int, completion_width: int,
             routes: tuple[int, ...] | None = None,
             pixels: tuple[int, ...] | None = None) -> "RolloutBatch":
        """The batch's global shapes and dtypes (`routes`: the (L, k) of routing replay;
        `pixels`: the (M, 3, H, W) of the prompts' images)."""
        p, g, w, n = prompts, group, width, completion_width
        sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
        return cls(sds((p, w), i32), sds((p,), i32), sds((p, g, n), i32), sds((p, g), i32),
                   sds((p, g, n), f32), sds((p, g, n), f32),
                   None if routes is None else sds((p, g, n, *routes), jnp.int16),
                   None if pixels is None else sds((p, *pixels), f32))

    def arrays(self) -> dict[str, jax.Array]:
        """The trainer batch's keys: every field that is not None."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}
