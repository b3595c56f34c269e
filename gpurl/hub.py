"""Weights and datasets by Hugging Face Hub id: `org/name` or `org/name@revision` (a
branch, tag or commit) wherever a checkpoint or a dataset goes.

`local_path` turns an id into a directory of huggingface_hub's cache (`HF_HOME`,
`HF_HUB_CACHE`), downloading only the files gpurl reads (safetensors, config, tokenizer;
a dataset's data files and card) unless `HF_HUB_OFFLINE=1`; gated repositories take
`HF_TOKEN`; `HF_ENDPOINT` names a mirror. An existing local path is returned unchanged, so
a directory named like an id (`runs/x`) always wins.

Many processes of one job start at once: the first to take the repository's file lock
in the cache downloads, the others wait for the lock and then read what it fetched (the
commit it resolved is recorded beside the lock for `FRESH_S` seconds, so they make no
request of their own). One process per host downloads with a per-host cache; one per job
with a cache on a shared file system that supports locks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpurl.config import ConfigError

# What gpurl reads of a model repository (gpurl.models: hf.py, tokenizer.py, chat_template.py):
# its description (what `gpurl plan`, the architecture and the tokenizer need), then its weights.
MODEL_META_FILES = ("model.safetensors.index.json", "config.json", "generation_config.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json")
MODEL_FILES = ("*.safetensors",) + MODEL_META_FILES
# What `datasets` reads of a dataset repository: its data files and the card whose YAML
# header names its configs (subsets) and splits.
DATASET_FILES = ("README.md", "*.parquet", "*.arrow", "*.jsonl", "*.json", "*.csv",
                 "*.jsonl.gz", "*.json.gz", "*.csv.gz")
# (repository type, files) by what a caller needs
FILES = {"model": ("model", MODEL_FILES), "model_meta": ("model", MODEL_META_FILES),
         "dataset": ("dataset", DATASET_FILES)}
# How long a resolved commit stands for the processes that waited on the download (and for
# a job started within that time: a push to the repository is seen after it).
FRESH_S = 600.0

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[\w](@[\w./-]+)?")


def is_hub_id(value: str | None) -> bool:
    """`value` reads as `org/name[@revision]` and is no existing local path (nor a
    `.gguf` file name, which only a local file can be)."""
    if not value or Path(value).expanduser().exists() or value.endswith(".gguf"):
        return False
    return (bool(_ID.fullmatch(value)) and not value.startswith((".", "~"))
            and "--" not in value and ".." not in value)  # as the Hub's ids


def split_id(value: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); no `@` -> revision None (the default branch)."""
    repo, _, revision = value.partition("@")
    return repo, revision or None


def offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> Path:
    """huggingface_hub's cache as the environment names it now (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def local_path(value: str, key: str, kind: str = "model", local: str | None = None) -> str:
    """`value` as a local path: unchanged when it is one (or is no hub id: the caller's own
    check then names it), else the cached snapshot of the Hub repository it names, holding
    the files `kind` needs (FILES: `model`, `model_meta` without the weights, `dataset`).
    `key` (`model.checkpoint`, `algo.teacher`, ...) names the setting in errors, `local` the
    alternative they offer (default: pointing `key` at a local copy)."""
    if not is_hub_id(value):
        return value
    repo, revision = split_id(value)
    return _snapshot(repo, revision, kind, key, local or f"point {key} at a local copy",
                     str(cache_dir()), offline())


def pinned(value: str, key: str, kind: str = "model_meta", local: str | None = None) -> str:
    """A Hub id as `org/name@<commit>` (the commit it resolves to now, fetched if needed),
    so that a resumed, evaluated or exported run reads what it started from; anything else
    unchanged. (A job of several processes pins through `gpurl.distributed.pins`, which
    gives them all process 0's commit.)"""
    if not is_hub_id(value):
        return value
    return f"{split_id(value)[0]}@{Path(local_path(value, key, kind, local)).name}"


def describe(value: str, key: str, kind: str = "model") -> str:
    """What a start would do with `value`, reading the cache only (`gpurl check`): a local
    path as is; a Hub id cached or to be fetched; offline and not cached, the start's own
    error."""
    if not is_hub_id(value):
        shadows = bool(_ID.fullmatch(value)) and not value.startswith((".", "~", "/"))
        return f"{value} (local{', not the Hub id' if shadows else ''})"
    repo, revision = split_id(value)
    cache = str(cache_dir())
    try:
        path = _download(repo, revision, kind, key, f"point {key} at a local copy", cache,
                         local_only=True)
    except ConfigError:
        if offline():
            raise
        return f"{value} (Hub id, not in the cache {cache}: fetched at start)"
    return f"{value} (Hub id, cached: {path})"


def cached(value: str, kind: str = "model") -> bool:
    """Whether a start would read `value` without fetching it: a local path, or a Hub id
    in the cache."""
    if not is_hub_id(value):
        return True
    repo, revision = split_id(value)
    try:
        _download(repo, revision, kind, "", "", str(cache_dir()), local_only=True)
    except ConfigError:
        return False
    return True


@functools.lru_cache(maxsize=None)  # once per process and repository (errors are not cached)
def _snapshot(repo: str, revision: str | None, kind: str, key: str, local: str, cache: str,
              is_offline: bool) -> str:
    if is_offline:  # the cache only: no lock, nothing written (a read-only cache works)
        return _download(repo, revision, kind, key, local, cache, local_only=True)
    from filelock import FileLock, Timeout

    stem = f"{kind}--{repo.replace('/', '--')}@{revision or 'default'}".replace("/", "--")
    locks = _lock_dir(Path(cache))
    note = locks / f"{stem}.json"
    lock = FileLock(str(locks / f"{stem}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[gpurl] {key}={_label(repo, revision)}: waiting for another process's download",
              file=sys.stderr, flush=True)
        lock.acquire()
    try:
        commit = _fresh_commit(note)
        if commit is not None:  # another process of this job has just fetched it
            return _download(repo, commit, kind, key, local, cache, local_only=True)
        print(f"[gpurl] {key}={_label(repo, revision)}: fetching from the Hugging Face Hub "
              f"what the cache ({cache}) lacks", file=sys.stderr, flush=True)
        path = _download(repo, revision, kind, key, local, cache, local_only=False)
        note.write_text(json.dumps({"commit": Path(path).name, "time": time.time()}))
        return path
    finally:
        lock.release()


def _lock_dir(cache: Path) -> Path:
    """Where the download locks live: in the cache (shared by whoever shares the cache),
    else, where the cache is read-only, in this host's temporary folder."""
    for folder in (cache / ".locks" / "gpurl", Path(tempfile.gettempdir()) / "gpurl-hub-locks"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise ConfigError(f"neither the Hugging Face cache ({cache}) nor {tempfile.gettempdir()} "
                      f"is writable; set HF_HOME to a writable folder.")


def _fresh_commit(note: Path) -> str | None:
    try:
        record = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    return record["commit"] if time.time() - record.get("time", 0) < FRESH_S else None


def _label(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def _download(repo: str, revision: str | None, kind: str, key: str, local: str, cache: str,
              local_only: bool) -> str:
    """huggingface_hub's snapshot of `repo`, its failures as one sentence each."""
    from huggingface_hub import errors, snapshot_download

    repo_type, files = FILES[kind]
    name = _label(repo, revision)
    page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo}"
    try:
        path = snapshot_download(repo, revision=revision, repo_type=repo_type, cache_dir=cache,
                                 allow_patterns=list(files), local_files_only=local_only,
                                 endpoint=os.environ.get("HF_ENDPOINT") or None)
    except errors.GatedRepoError:
        raise ConfigError(f"{key}={name} is gated on the Hugging Face Hub; accept its terms at "
                          f"{page} and set HF_TOKEN to a token of that account.") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{key}={name}: {repo} has no revision {revision!r} on the Hub; name "
                          f"a branch, tag or commit it has.") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{key}={name} is neither a local path nor a {repo_type} on the "
                          f"Hugging Face Hub (or it is private: set HF_TOKEN); check the "
                          f"spelling.") from None
    except errors.HFValidationError:
        raise ConfigError(f"{key}={name} is neither an existing local path nor a valid Hub id "
                          f"(org/name[@revision]); check the spelling.") from None
    except errors.LocalEntryNotFoundError:
        parent = Path(repo).parent
        if parent.is_dir():  # `runs/grpo` with runs/ here: a mistyped path, not an id
            raise ConfigError(f"{key}={name} does not exist: {parent}/ holds no {Path(repo).name} "
                              f"(and no Hub id {repo} is cached); check the path's spelling.") from None
        if local_only:
            raise ConfigError(f"{key}={name} is not in the Hugging Face cache ({cache}) and "
                              f"HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) forbids downloading "
                              f"it; run once with HF_HUB_OFFLINE=0 on a machine with internet, "
                              f"or {local}.") from None
        raise ConfigError(f"{key}={name} is not in the Hugging Face cache ({cache}) and the "
                          f"Hub ({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}) cannot be "
                          f"reached; connect this machine, or {local}.") from None
    except errors.HfHubHTTPError as e:
        raise ConfigError(f"{key}={name}: the Hub refused the download ({_status(e)}); check "
                          f"HF_TOKEN and the id.") from None
    except (OSError, ConnectionError) as e:  # a full disk, a connection lost mid-file
        raise ConfigError(f"{key}={name}: the download into {cache} failed ({type(e).__name__}); "
                          f"rerun to resume it, after freeing disk space if it is full.") from None
    if kind == "model" and not any(Path(path).glob("*.safetensors")):
        raise ConfigError(f"{key}={name} holds no safetensors weights (gpurl reads those); pick "
                          f"a repository with *.safetensors files or a local .gguf file.")
    return path


def _status(error: Any) -> str:
    response = getattr(error, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(error).__name__
