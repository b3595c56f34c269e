"""Preference pairs for DPO, SimPO and ORPO: {"prompt", "chosen", "rejected"} rows -> arrays.

Sources: data files or cached HF datasets of such rows (TRL's explicit- and implicit-
prompt layouts too, `layouts.py`; `data.eval_path`, or a seeded hold-out of
`data.num_eval` rows), and the built-in `data=addition_prefs` (`arithmetic_prefs` items:
the correct answer against a plausible wrong one, with few-shot prompts). Other fields of
a row (e.g. "answer") are kept: held-out task accuracy reads them.

A pair is stored as one prompt and two completions, chosen first, so the leading axis of
every array counts pairs: micro-batches and shards never separate a pair, and the prompt
goes through the model once for both completions (`group_logprobs` with G = 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from gpurl.config import ConfigError, DataConfig
from gpurl.data.sft import _chat_texts
from gpurl.data.sources import load_examples, load_rows

if TYPE_CHECKING:
    from gpurl.models.tokenizer import Tokenizer

PAIR_FIELDS = ("prompt", "chosen", "rejected")
# Generated sources whose rows are pairs (the others have one completion per prompt).
PAIR_TASKS = ("arithmetic_prefs",)


def load_pairs(cfg: DataConfig) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) preference rows; the two never share a prompt."""
    if cfg.name in PAIR_TASKS:
        return load_examples(cfg)
    if cfg.name not in ("jsonl", "hf"):
        raise ConfigError(f"data={cfg.name} has no preference pairs; use data=addition_prefs, "
                          'or data=jsonl / data=hf with {"prompt", "chosen", "rejected"} rows.')
    return load_rows(cfg, "pairs")


@dataclass(frozen=True)
class PairRows:
    """N encoded pairs; completion index 0 is the chosen one, 1 the rejected one."""

    prompt_tokens: np.ndarray  # N x W int32: BOS + prompt, right-padded with pad_id
    prompt_lengths: np.ndarray  # N int32
    completions: np.ndarray  # N x 2 x C int32, pad_id after each completion's length
    completion_lengths: np.ndarray  # N x 2 int32
    rows: list[dict]  # the source rows kept (prompt text and metadata such as "answer")
    num_skipped: int  # pairs longer than data.max_len, left out

    def __len__(self) -> int:
        return int(self.prompt_lengths.shape[0])


def encode_pairs(rows: list[dict], tokenizer: Tokenizer, cfg: DataConfig, what: str) -> PairRows:
    """Token arrays of `rows`. With `cfg.chat_template` the prompt is rendered as a user
    turn with the generation prompt and each completion as the assistant reply (as in
    SFT); with `cfg.append_eos` both completions end with EOS. Pairs whose prompt plus
    longer completion exceed `cfg.max_len` tokens are skipped and counted."""
    if any(row.get("images") for row in rows):
        raise ConfigError(f"{what} pairs have images, which only algo=sft trains on so far; "
                          f"train a vision-language model with algo=sft or drop the images.")
    texts = [_texts(row, tokenizer, cfg.chat_template) for row in rows]
    prompt_ids = tokenizer.encode_batch([t[0] for t in texts])
    chosen_ids = tokenizer.encode_batch([t[1] for t in texts])
    rejected_ids = tokenizer.encode_batch([t[2] for t in texts])
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [tokenizer.eos_id] if cfg.append_eos else []
    kept = []
    for i, (p, c, r) in enumerate(zip(prompt_ids, chosen_ids, rejected_ids)):
        if not c or not r:
            raise ConfigError(f"{what} pair {i} (prompt {rows[i]['prompt'][-40:]!r}) has an empty "
                              f"chosen or rejected completion; give both some text.")
        if len(bos) + len(p) + len(eos) + max(len(c), len(r)) <= cfg.max_len:
            kept.append((i, bos + p, c + eos, r + eos))
    if not kept:
        raise ConfigError(f"every {what} pair is longer than data.max_len={cfg.max_len} tokens; "
                          f"raise data.max_len.")
    n, width = len(kept), max(len(p) for _, p, _, _ in kept)
    comp_width = max(max(len(c), len(r)) for _, _, c, r in kept)
    prompt_PxW = np.full((n, width), tokenizer.pad_id, np.int32)
    comp_Px2xN = np.full((n, 2, comp_width), tokenizer.pad_id, np.int32)
    comp_len_Px2 = np.zeros((n, 2), np.int32)
    for j, (_, p, c, r) in enumerate(kept):
        prompt_PxW[j, :len(p)] = p
        for k, ids in enumerate((c, r)):
            comp_Px2xN[j, k, :len(ids)] = ids
            comp_len_Px2[j, k] = len(ids)
    return PairRows(prompt_PxW, np.asarray([len(p) for _, p, _, _ in kept], np.int32),
                    comp_Px2xN, comp_len_Px2, [rows[i] for i, *_ in kept], len(rows) - n)


def _texts(row: dict, tokenizer: Tokenizer, chat: bool) -> tuple[str, str, str]:
    if not chat:
        return row["prompt"], row["chosen"], row["rejected"]
    context = {k: row[k] for k in ("prompt", "messages") if row.get(k)}
    prompt, chosen = _chat_texts({**context, "completion": row["chosen"]}, tokenizer)
    _, rejected = _chat_texts({**context, "completion": row["rejected"]}, tokenizer)
    return prompt, chosen, rejected


def take_pairs(pairs: PairRows, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The batch arrays of pairs `indices`; index -1 is a padding pair (copies of pair 0
    with zero masks, so eval batches keep one shape)."""
    real_P = indices >= 0
    idx = np.where(real_P, indices, 0)
    comp_len_Px2 = pairs.completion_lengths[idx]
    slots = np.arange(pairs.completions.shape[2])
    mask_Px2xN = (slots < comp_len_Px2[..., None]) & real_P[:, None, None]
    return {"prompt_tokens": pairs.prompt_tokens[idx], "prompt_lengths": pairs.prompt_lengths[idx],
            "completions": pairs.completions[idx], "completion_lengths": comp_len_Px2,
            "comp_mask": mask_Px2xN.astype(np.float32), "pair_mask": real_P.astype(np.float32)}
