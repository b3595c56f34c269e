"""What callers give the rollout engine and get back: `Request` and `Completion`, and the
shape buckets of its programs. Plain Python (the scheduler's tests import it without JAX)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpurl.buckets import power_of_two as bucket
from gpurl.config import ConfigError

MIN_PROMPT_BUCKET = 16
MIN_ROWS = 2  # prefill rows: XLA's one-row matmul rounds differently from its batched one
MIN_DECODE_ROWS = 8


def prompt_width(tokens: int) -> int:
    """The padded width of prompts of up to `tokens` tokens (a power of two, >= 16)."""
    return bucket(tokens, MIN_PROMPT_BUCKET)


@dataclass(frozen=True)
class Request:
    """One completion to generate. `offset`: tokens already drawn for this completion
    before (a resumed request), so its sampling keys continue where they stopped."""

    prompt: tuple[int, ...]  # token ids, BOS included
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None  # None: the engine's (EOS + rollout.stop)
    offset: int = 0
    # a vision-language model's prompt: its images' pixels (3 x H x W float32 each, in the
    # order its image tokens come) and a digest of them, which keeps sequences with the
    # same tokens but other images apart in the scheduler and the prefix cache
    images: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    images_key: str = ""

    def state(self) -> dict:
        """As plain data (a checkpoint's JSON); `from_state` rebuilds it."""
        if self.images:
            raise ConfigError("a request with images cannot be written into a checkpoint "
                              "mid-stream; use rollout.mode=sync or one_ahead with images.")
        return {**self.__dict__, "prompt": list(self.prompt),
                "stop_ids": None if self.stop_ids is None else list(self.stop_ids)}

    @staticmethod
    def from_state(data: dict) -> "Request":
        stop = data["stop_ids"]
        return Request(**{**data, "prompt": tuple(data["prompt"]),
                          "stop_ids": None if stop is None else tuple(stop)})


@dataclass
class Completion:
    tokens: np.ndarray  # int32: generated tokens, the stop token included
    logprobs: np.ndarray  # float32: log-prob of each under the distribution sampled from
    stopped: bool  # ended on a stop id (else at max_new_tokens)
    # routing replay: the experts each token was routed to when it was fed back in
    # (N x L sparse layers x k, int16; -1 where none was recorded: the last token, and
    # tokens a recompute or resume prefill fed); None unless model.moe.replay_routing
    routes: np.ndarray | None = None
    # int32: the policy version that sampled each token (`Engine.stream`: the version the
    # caller passes with the parameters); 0 for every token of a plain `generate`
    versions: np.ndarray | None = None
