"""The tokenizer a GGUF file describes, rebuilt from its `tokenizer.ggml.*` metadata.

Supported: `tokenizer.ggml.model = llama` (SentencePiece BPE with byte fallback) in Gemma
files. The result tokenizes like transformers' GGUF loader (`AutoTokenizer.from_pretrained(
dir, gguf_file=...)`), which is the reference in tests/test_gguf.py.

Gemma GGUFs list no BPE merges, only the vocabulary in merge order: a token with a lower
id was merged earlier in SentencePiece training (the scores do not follow that order).
So every way to cut a token into two vocabulary pieces becomes a merge, ranked by the
token's id, and among the cuts of one token the longer left piece first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, processors

from gpurl.config import ConfigError
from gpurl.models import families
from gpurl.models.gguf import GGUFFile, read_gguf
from gpurl.models.tokenizer import Tokenizer

SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp token types (llama_token_type): 3 control (special), 4 user-defined (added)
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Tokenizer, special ids and chat template of a GGUF file."""
    gguf = read_gguf(path)
    meta = gguf.metadata
    model = meta.get("tokenizer.ggml.model")
    family = families.by_gguf_arch(gguf.architecture)
    if model != "llama" or family is None or not family.gguf.tokenizer:
        raise ConfigError(
            f"{gguf.path} has a {model!r} tokenizer for a {gguf.architecture!r} model, and gpurl "
            "rebuilds only Gemma's SentencePiece tokenizer from GGUF; set "
            "model.tokenizer=/path/to/tokenizer.json.")
    tokens = _required(gguf, "tokenizer.ggml.tokens")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise _damaged(gguf, "tokenizer.ggml.tokens", "is not a list of strings")
    types_V = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens), np.int32)))
    if types_V.shape != (len(tokens),) or types_V.dtype.kind not in "iu":
        raise _damaged(gguf, "tokenizer.ggml.token_type", f"does not give one integer type to "
                                                          f"each of the {len(tokens)} tokens")
    unk_id = _token_id(gguf, "tokenizer.ggml.unknown_token_id", len(tokens))
    tok = _sentencepiece_bpe(tokens, unk="<unk>" if unk_id is None else tokens[unk_id])
    _add_tokens(tok, tokens, types_V)
    eos_id = _token_id(gguf, "tokenizer.ggml.eos_token_id", len(tokens), required=True)
    bos_id = _token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
    if add_bos:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    pad_id = _token_id(gguf, "tokenizer.ggml.padding_token_id", len(tokens))
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise _damaged(gguf, "tokenizer.chat_template", "is not a string")
    return Tokenizer(tok, eos_id=eos_id, pad_id=eos_id if pad_id is None else pad_id,
                     bos_id=bos_id if add_bos else None, chat_template=template)


def _required(gguf: GGUFFile, key: str) -> object:
    if key not in gguf.metadata:
        raise ConfigError(f"{gguf.path} lacks the metadata key {key}; convert the model again "
                          "with a recent llama.cpp or set model.tokenizer=/path/to/tokenizer.json.")
    return gguf.metadata[key]


def _damaged(gguf: GGUFFile, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{gguf.path}: {key} {problem}; the file is damaged, download or convert "
                       "it again, or set model.tokenizer=/path/to/tokenizer.json.")


def _token_id(gguf: GGUFFile, key: str, vocab: int, required: bool = False) -> int | None:
    """A special token's id from the metadata: an integer below the vocabulary size."""
    value = _required(gguf, key) if required else gguf.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value < vocab:
        raise _damaged(gguf, key, f"is {str(value)[:40]!r}, not a token id below {vocab}")
    return int(value)


def _respell(token: str) -> str:
    # Gemma files write the multi-space tokens with real spaces; the normalizer below turns
    # every space into SPACE, so only the SPACE spelling can ever match.
    return SPACE * len(token) if " " in token and not token.strip() else token


def rebuild_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary listed in merge order (see the module docstring)."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        merges.extend((token[:i], token[i:]) for i in range(len(token) - 1, 0, -1)
                      if token[:i] in vocab and token[i:] in vocab)
    return merges


def _sentencepiece_bpe(tokens: list[str], unk: str) -> tokenizers.Tokenizer:
    vocab = {_respell(t): i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=rebuild_merges(vocab), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    # No pre-tokenizer: as in SentencePiece, BPE runs over the whole text, spaces included
    # (transformers' Split on " " after this normalizer never fires).
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _add_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types_V: np.ndarray) -> None:
    """Control tokens become special tokens; user-defined ones (e.g. "\\n\\n", "<table>") are
    matched whole in the raw text, as llama.cpp does, unless respelled above."""
    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i in np.flatnonzero(types_V == _CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i in np.flatnonzero(types_V == _USER_DEFINED) if tokens[i] in vocab])
