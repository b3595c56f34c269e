"""Prompts as the sampler reads them: token ids (BOS included) beside their data rows.

Every prompt the model samples from (training rollouts, continuous ones, `gpurl eval`,
`gpurl generate`) is encoded here. With an environment that calls tools, a prompt
rendered through the chat template carries the tools' schemas (`tools=`, as HF
`apply_chat_template` and TRL pass them), so the model is shown what it may call. A
plain-text prompt (`data.chat_template=false`, no messages) is the text as it is: no
schema format is made up for it, and the model knows the tools only as far as the
prompt says (the calculator task's worked examples show its calls).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gpurl.config import ConfigError, EnvConfig
from gpurl.data.images import gemma3_pixels, image_key, open_image
from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards.thinking import left_open
from gpurl.rollout.multiturn import EnvFactory


@dataclass(frozen=True)
class Prompts:
    """Rows (prompt text + metadata), their token ids (BOS included), and which of them
    leave a thinking trace open for the model (empty: none)."""

    rows: list[dict]
    tokens: list[list[int]]
    opened: tuple[bool, ...] = ()
    image_size: int = 0  # a vision-language model's image side in pixels (0: text prompts)
    _pixels: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def pixels_shape(self) -> tuple[int, ...] | None:
        """(M, 3, H, W) of the prompts' images in a batch, M the most any prompt has; None
        for text prompts."""
        most = max((len(row.get("images") or ()) for row in self.rows), default=0)
        return (most, 3, self.image_size, self.image_size) if most else None

    def pixels(self, indices: Sequence[int]) -> np.ndarray:
        """B x M x 3 x H x W: the images of prompts `indices` (-1: none), `pixels_shape`."""
        out = np.zeros((len(indices), *self.pixels_shape), np.float32)
        for b, i in enumerate(indices):
            images = self.images(i)[0]
            out[b, :len(images)] = images
        return out

    def images(self, index: int) -> tuple[tuple[np.ndarray, ...], str]:
        """(prompt `index`'s images as pixels, each 3 x H x W, and their digest: what its
        requests carry, `Request.images`); read once per prompt and kept. -1 or a prompt
        without images: ((), "")."""
        if index < 0 or not self.rows[index].get("images"):
            return (), ""
        if index not in self._pixels:
            sources = self.rows[index]["images"]
            pixels = tuple(gemma3_pixels(open_image(src, f"prompt {index}'s image {j}"),
                                         self.image_size) for j, src in enumerate(sources))
            digest = hashlib.sha256(repr([image_key(src) for src in sources]).encode())
            self._pixels[index] = (pixels, digest.hexdigest()[:32])
        return self._pixels[index]

    def opens(self, index: int) -> bool:
        """Whether prompt `index` (-1: padding) leaves a thinking trace open
        (`gpurl.rewards.thinking`: its completion must close it to be finished)."""
        return bool(self.opened) and index >= 0 and self.opened[index]


def prompt_tools(env: EnvConfig | None) -> list[dict]:
    """The function schemas of the tools `env` calls, as chat templates read them
    (`Tool.function`); [] without an environment or with one that calls no tools."""
    if env is None or not env.on or env.agents:  # an agent shows its own tools in its calls
        return []
    return [tool.function for tool in EnvFactory(env).tools]


def render_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool,
                  tools: Sequence[dict] = ()) -> str:
    """The text a prompt is encoded from (BOS not included): a prompt text as it is, or
    chat messages (or a text with `chat`) rendered through the tokenizer's chat template
    with the generation prompt and `tools` (the environment's function schemas,
    `prompt_tools`; unused for a plain text)."""
    if not (chat or isinstance(prompt, list)):
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         tools=list(tools) or None)
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token):]
    return text


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool,
                  tools: Sequence[dict] = ()) -> list[int]:
    """Token ids of a prompt (`render_prompt`), BOS first."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(render_prompt(tokenizer, prompt, chat, tools))


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, chat: bool, max_len: int,
                   what: str, tools: Sequence[dict] = ()) -> tuple[Prompts, int]:
    """Token ids of each prompt (`encode_prompt`) and whether it leaves a thinking trace
    open (a template such as DeepSeek-R1-Distill's opens `<think>` in its generation
    prompt); prompts longer than `max_len` tokens are skipped (the count is returned and
    reported)."""
    kept, tokens, opened, skipped = [], [], [], 0
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for x, row in enumerate(rows):
        text = render_prompt(tokenizer, row.get("messages") or row["prompt"], chat, tools)
        ids = bos + (_image_ids(text, row, x, tokenizer, what) if row.get("images")
                     else tokenizer.encode(text))
        if len(ids) > max_len:
            skipped += 1
            continue
        kept.append(row)
        tokens.append(ids)
        opened.append(left_open(text))
    if not kept:
        raise ConfigError(f"every {what} prompt is longer than data.max_len={max_len} tokens; "
                          f"raise data.max_len.")
    size = tokenizer.images.size if tokenizer.images is not None else 0
    return Prompts(kept, tokens, tuple(opened), size), skipped


def _image_ids(text: str, row: dict, x: int, tokenizer: Tokenizer, what: str) -> list[int]:
    """Token ids of a prompt with images, its image markers expanded (`ImageTokens`)."""
    if tokenizer.images is None:
        raise ConfigError(f"{what} prompts have images but the model is a text model; use a "
                          f"vision-language model (model.vision.layers > 0) or drop the images.")
    ids, counts = tokenizer.images.encode([text], tokenizer.encode_batch)
    if counts[0] != len(row["images"]):
        raise ConfigError(f"{what} prompt {x} gives {len(row['images'])} image(s) but places "
                          f"{counts[0]} (an image part or <start_of_image> marks each); give "
                          f"one image per image part.")
    return ids[0]


def request_images(prompts: Prompts, index: int) -> dict[str, Any]:
    """`Request` fields of prompt `index`'s images (none for -1 or a text prompt)."""
    pixels, key = prompts.images(index)
    return {"images": pixels, "images_key": key} if pixels else {}
