"""Host side of generation: stop strings as token ids, and text cut at a stop string."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from gpurl.models.tokenizer import Tokenizer


@lru_cache(maxsize=8)
def _token_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    ids = [[i] for i in range(tokenizer.vocab_size)]
    return tuple(tokenizer.tok.decode_batch(ids, skip_special_tokens=False))


def stop_token_ids(tokenizer: Tokenizer, stop: Sequence[str], eos: bool = True) -> list[int]:
    """EOS (unless `eos` is false: rollout.ignore_eos) plus every token whose text contains a
    stop string: the device stops on them; `truncate` then cuts the text at the stop string
    itself."""
    ids = {tokenizer.eos_id} if eos else set()
    if stop:
        ids |= {i for i, text in enumerate(_token_texts(tokenizer)) if any(s in text for s in stop)}
    return sorted(ids)


def truncate(text: str, stop: Sequence[str]) -> str:
    """Text before the first stop string."""
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    return text[:cut]
