"""Supervised fine-tuning rows: examples -> fixed-width token arrays with a loss mask.

Each example becomes `[bos] + prompt + completion + [eos]`. Loss falls on the completion
and the eos only, so the model learns to answer and to stop, not to reproduce prompts.
With `data.packing`, several examples share a row; `segment_ids` and per-example
`positions` keep attention and RoPE confined to each example.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gpurl.config import ConfigError, DataConfig
from gpurl.data.images import gemma3_pixels, open_image
from gpurl.kernels.segments import BRANCHES

if TYPE_CHECKING:
    from gpurl.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenRows:
    """B rows of T tokens (arrays B x T); in building them X counts examples and Z the
    tokens of all examples one after another (`gpurl.glossary`)."""

    tokens: np.ndarray  # B x T int32, pad_id where empty
    positions: np.ndarray  # B x T int32, position within its own example (0 at each start)
    segment_ids: np.ndarray  # B x T int32, 1.. per example within a row, 0 = padding
    # B x T float32: 1.0 where tokens[b, t] is a completion token (or the final eos)
    # predicted from position t - 1; i.e. aligned with the targets, not the inputs.
    loss_mask: np.ndarray
    num_truncated: int  # examples longer than T that lost their tail
    pad_id: int = 0  # token id of empty slots (eval batches pad with it)
    # a vision-language model's rows: each row's images (sources: `gpurl.data.images.
    # open_image`) in the order its image tokens come, read and resized to `image_size`
    # pixels a side when a batch takes the row (`pixels`); None for text rows
    images: tuple[tuple[Any, ...], ...] | None = None
    image_size: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def pixels(self, indices: np.ndarray) -> np.ndarray:
        """B x M x 3 x H x W float32: the images of rows `indices`, M the most any row has
        (slots past a row's own images are zeros, never read by the model)."""
        m = max(1, max(map(len, self.images)))
        out = np.zeros((len(indices), m, 3, self.image_size, self.image_size), np.float32)
        for b, row in enumerate(indices):
            for j, source in enumerate(self.images[row]):
                out[b, j] = gemma3_pixels(open_image(source, f"row {row}'s image {j}"),
                                          self.image_size)
        return out


def encode_sft(examples: list[dict], tokenizer: Tokenizer, cfg: DataConfig) -> TokenRows:
    """Tokenize `examples` ({"prompt", "completion"[, "messages"]}) into rows of cfg.max_len.

    With `cfg.chat_template`, the prompt is the conversation (`messages`, or the prompt as
    one user turn) rendered with the generation prompt, and the completion is what the
    template adds for the assistant reply: its content plus the end-of-turn marker,
    trailing whitespace dropped. A leading bos_token in the rendered prompt is removed
    because the bos id is added here. Without it, prompt and completion are used as is.
    """
    if not examples:
        raise ConfigError("There are no examples to encode; give data.path rows or set "
                          "data.num_train / data.num_eval above 0.")
    if cfg.chat_template:
        prompts, completions = zip(*(_chat_texts(ex, tokenizer) for ex in examples))
    else:
        prompts = [ex["prompt"] for ex in examples]
        completions = [ex["completion"] for ex in examples]
    images = None
    if any(ex.get("images") for ex in examples):  # a vision-language model's examples
        images = [list(ex.get("images") or ()) for ex in examples]
        prompt_ids = image_prompt_ids(list(prompts), images, tokenizer)
    else:
        prompt_ids = tokenizer.encode_batch(list(prompts))
    completion_ids = tokenizer.encode_batch(list(completions))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    trained = None
    if any("trajectory" in ex for ex in examples):  # recorded trajectories: model turns only
        completion_ids, trained = _segments(examples, completion_ids, tokenizer)
        trained = [[False] * (len(bos) + len(p)) + t + [True] for p, t in zip(prompt_ids, trained)]
    seqs = [bos + p + c + [tokenizer.eos_id] for p, c in zip(prompt_ids, completion_ids)]
    prompt_len_X = np.array([len(bos) + len(p) for p in prompt_ids], dtype=np.int64)
    rows, row_X = _layout(seqs, prompt_len_X, cfg.max_len, cfg.packing, tokenizer.pad_id, trained)
    if images is None:
        return rows
    return _with_images(rows, row_X, seqs, images, tokenizer.images, cfg.max_len)


def image_prompt_ids(prompts: list[str], images: list[list[Any]],
                     tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of prompts whose image markers are expanded to the model's image tokens
    (`gpurl.models.vision.ImageTokens`); one sentence when the model has no vision tower
    or a prompt's markers do not match its images."""
    if tokenizer.images is None:
        raise ConfigError("the data has images but the model is a text model; use a "
                          "vision-language model (model.vision.layers > 0) or drop the images.")
    ids, counts = tokenizer.images.encode(prompts, tokenizer.encode_batch)
    for x, (count, given) in enumerate(zip(counts, images)):
        if count != len(given):
            raise ConfigError(f"example {x} gives {len(given)} image(s) but its prompt places "
                              f"{count} (an image part or <start_of_image> marks each); give "
                              f"one image per image part.")
    return ids


def _with_images(rows: TokenRows, row_X: np.ndarray, seqs: list[list[int]],
                 images: list[list[Any]], tokens: Any, max_len: int) -> TokenRows:
    """`rows` with each row's images (its examples', in order); one sentence when an
    example's image tokens do not fit in data.max_len (a cut image has no features)."""
    for x, seq in enumerate(seqs):
        if images[x] and len(seq) > max_len and tokens.end in seq[max_len:]:
            raise ConfigError(f"example {x}'s images end past data.max_len={max_len} tokens "
                              f"({tokens.count} per image); raise data.max_len or give "
                              f"fewer images per example.")
    # a row's examples lie in it in example order (`_first_fit` appends)
    per_row: list[list[Any]] = [[] for _ in range(len(rows))]
    for row, given in zip(row_X, images):
        per_row[row] += given
    return replace(rows, images=tuple(tuple(r) for r in per_row), image_size=tokens.size)


def _segments(examples: list[dict], completion_ids: list[list[int]],
              tokenizer: Tokenizer) -> tuple[list[list[int]], list[list[bool]]]:
    """Token ids of each completion and whether each is trained: a trajectory's segments
    tokenized one by one, trained where its segment says (observations are not); other
    completions are trained throughout."""
    ids_out, trained = [], []
    for ex, ids in zip(examples, completion_ids):
        if "trajectory" not in ex:
            ids_out.append(ids)
            trained.append([True] * len(ids))
            continue
        segments = ex["trajectory"]
        pieces = tokenizer.encode_batch([s["text"] for s in segments])
        ids_out.append([t for piece in pieces for t in piece])
        trained.append([s["train"] for s, piece in zip(segments, pieces) for _ in piece])
    return ids_out, trained


def _chat_texts(example: dict, tokenizer: Tokenizer) -> tuple[str, str]:
    """(prompt, completion) text of one example rendered through the chat template."""
    if "messages" in example:
        messages = list(example["messages"])
    else:
        messages = [{"role": "user", "content": example["prompt"]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = [{"role": "assistant", "content": example["completion"]}]
    full = tokenizer.apply_chat_template(messages + reply)
    # Templates that rewrite earlier turns once a reply follows (e.g. dropping reasoning)
    # break the prefix property; fall back to the raw reply rather than guess.
    completion = full[len(prompt):].rstrip() if full.startswith(prompt) else example["completion"]
    bos_token = tokenizer.bos_token
    if tokenizer.bos_id is not None and bos_token and prompt.startswith(bos_token):
        prompt = prompt[len(bos_token):]
    return prompt, completion


def _layout(seqs: list[list[int]], prompt_len_X: np.ndarray, T: int, packing: bool,
            pad_id: int, trained: list[list[bool]] | None = None
            ) -> tuple[TokenRows, np.ndarray]:
    """Place each (right-truncated) sequence in its row and build the row arrays at once:
    (the rows, each sequence's row). `trained`: per token of each sequence, whether it
    may carry loss (beside the rule that prompts do not)."""
    full_len_X = np.array([len(s) for s in seqs], dtype=np.int64)
    flat_Z = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32,
                         count=int(full_len_X.sum()))
    pos_Z = np.arange(flat_Z.size) - np.repeat(np.cumsum(full_len_X) - full_len_X, full_len_X)
    keep_Z = pos_Z < T
    len_X = np.minimum(full_len_X, T)
    flat_Z, pos_Z = flat_Z[keep_Z], pos_Z[keep_Z]
    if trained is not None:
        trained_Z = np.fromiter(itertools.chain.from_iterable(trained), dtype=bool,
                                count=int(full_len_X.sum()))[keep_Z]

    num_examples = len(seqs)
    if packing:
        row_X, offset_X, seg_X = _first_fit(len_X.tolist(), T)
    else:
        row_X = np.arange(num_examples)
        offset_X, seg_X = np.zeros(num_examples, np.int64), np.ones(num_examples, np.int64)
    num_rows = int(row_X.max()) + 1

    dest_Z = np.repeat(row_X * T + offset_X, len_X) + pos_Z
    # The first token of an example has nothing before it in its segment to predict from.
    first_loss_X = np.maximum(prompt_len_X, 1)
    tokens = np.full(num_rows * T, pad_id, np.int32)
    positions = np.zeros(num_rows * T, np.int32)
    segment_ids = np.zeros(num_rows * T, np.int32)
    loss_mask = np.zeros(num_rows * T, np.float32)
    tokens[dest_Z] = flat_Z
    positions[dest_Z] = pos_Z
    segment_ids[dest_Z] = np.repeat(seg_X, len_X)
    loss_mask[dest_Z] = pos_Z >= np.repeat(first_loss_X, len_X)
    if trained is not None:
        loss_mask[dest_Z] *= trained_Z
    shape = (num_rows, T)
    return TokenRows(tokens.reshape(shape), positions.reshape(shape), segment_ids.reshape(shape),
                     loss_mask.reshape(shape), int((full_len_X > T).sum()), pad_id), row_X


def _first_fit(len_X: list[int], T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy first-fit bin packing in example order: (row, offset, segment id) per example.

    A max-tree over the free space of every potential row (one per example, all empty at
    first) finds the lowest row with room in O(log X), so packing a large dataset stays
    fast; an unopened row is simply the first empty leaf. A row takes at most
    BRANCHES - 1 examples: larger segment ids would read as shared-prefix branches
    (`gpurl.kernels.segments`).
    """
    size = 1 << max(len(len_X) - 1, 0).bit_length()
    free = [0] * size + [T] * len(len_X) + [0] * (size - len(len_X))
    for node in range(size - 1, 0, -1):
        free[node] = max(free[2 * node], free[2 * node + 1])
    used = [0] * len(len_X)  # tokens already placed in each row
    count = [0] * len(len_X)  # examples already placed in each row
    rows, offsets, segs = [], [], []
    for length in len_X:
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        row = node - size
        rows.append(row)
        offsets.append(used[row])
        count[row] += 1
        segs.append(count[row])
        used[row] += length
        free[node] = 0 if count[row] == BRANCHES - 1 else free[node] - length
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return np.array(rows), np.array(offsets), np.array(segs)
