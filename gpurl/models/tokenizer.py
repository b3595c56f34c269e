"""Tokenizers: a thin wrapper over `tokenizers.Tokenizer` with special ids and a chat template.

Two sources: the built-in byte tokenizer (`model.tokenizer=bytes`, 259 ids, built offline,
lossless on any unicode string) for tiny models trained from scratch, and a Hugging Face
`tokenizer.json` (plus `tokenizer_config.json` beside it) for real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from gpurl.config import ConfigError
from gpurl.models.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat_template

# Same convention as Gemma (pad 0, eos 1, bos 2), so id-level code is tested on the real one.
BYTE_SPECIALS = ("<pad>", "<eos>", "<bos>")

# Tried in order when tokenizer_config.json does not name an end-of-sequence token.
_EOS_FALLBACKS = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>")


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` plus special ids and an optional Jinja chat template."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_id: int, pad_id: int,
                 bos_id: int | None = None, chat_template: str | None = None) -> None:
        self.tok = tok
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        # a vision-language model's image tokens (`gpurl.models.vision.ImageTokens`; set by
        # `gpurl.models.loading.load_tokenizer`), None for a text model
        self.images: Any = None
        # get_vocab_size can undercount when added-token ids leave gaps; the model's
        # embedding must cover the largest id.
        self.vocab_size: int = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def bos_token(self) -> str:
        return "" if self.bos_id is None else (self.tok.id_to_token(self.bos_id) or "")

    @property
    def eos_token(self) -> str:
        return self.tok.id_to_token(self.eos_id) or ""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (parallel in Rust), no special tokens added."""
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of `ids`, skipping special tokens and ids outside the vocabulary.

        Out-of-vocabulary ids occur when the model's embedding is larger than the
        tokenizer (model.vocab_size > vocab_size) and a sampler picks one of the extra rows.
        """
        ids_T = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids_T = ids_T[(ids_T >= 0) & (ids_T < self.vocab_size)]
        return self.tok.decode(ids_T.tolist(), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tools: list[dict] | None = None) -> str:
        """Render a conversation to text with this tokenizer's chat template (`tools`: the
        function schemas it shows the model, as in HF `apply_chat_template`)."""
        if self.chat_template is None:
            raise ConfigError(
                "This tokenizer has no chat template; add chat_template to its "
                "tokenizer_config.json or set data.chat_template=false.")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token,
                                    tools=tools)


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: ids 0..2 are <pad> <eos> <bos>, then the 256 bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Sort by byte value so id - 3 is the byte each symbol stands for.
    byte_of = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    assert sorted(alphabet) == sorted(byte_of), "ByteLevel alphabet changed"
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({ch: len(BYTE_SPECIALS) + byte_of[ch] for ch in alphabet})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    # Text that happens to contain "<eos>" must stay bytes, or decode(encode(s)) != s.
    tok.encode_special_tokens = True
    return Tokenizer(tok, eos_id=1, pad_id=0, bos_id=2, chat_template=DEFAULT_CHAT_TEMPLATE)


def _bytes_to_unicode() -> list[str]:
    """The GPT-2 byte -> printable character map that ByteLevel uses, indexed by byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def load_tokenizer_json(path_str: str) -> Tokenizer:
    path = Path(path_str).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"model.tokenizer={path_str} does not exist; point it to a tokenizer.json "
            "file or use bytes.")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust loader raises plain Exception
        raise ConfigError(
            f"model.tokenizer={path_str} is not a valid tokenizer.json ({e}); point it to a "
            "Hugging Face tokenizer.json file or use bytes.") from e
    config = _read_tokenizer_config(path.parent)

    def token_id(key: str) -> int | None:
        name = _token_name(config.get(key))
        return None if name is None else tok.token_to_id(name)

    eos_id = token_id("eos_token")
    if eos_id is None:
        found = (tok.token_to_id(name) for name in _EOS_FALLBACKS)
        eos_id = next((i for i in found if i is not None), None)
    if eos_id is None:
        raise ConfigError(
            f"Found no end-of-sequence token for {path}; set eos_token in "
            f"{path.parent / 'tokenizer_config.json'}.")
    pad_id = token_id("pad_token")
    # Without a pad token, eos pads: padded slots are masked out, so any id works.
    return Tokenizer(tok, eos_id=eos_id, pad_id=eos_id if pad_id is None else pad_id,
                     bos_id=token_id("bos_token"),
                     chat_template=_chat_template(path.parent, config))


def _read_tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or delete the file.") from e


def _token_name(entry: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or {"content": ...} dicts."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # Newer HF exports keep the template in its own file.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.tok.id_to_token(tokenizer.pad_id),
        "bos_token": tokenizer.bos_token or None,
        "add_bos_token": tokenizer.bos_id is not None,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
