"""Tables of rows through the Hugging Face `datasets` library, memory-mapped, never copied.

`open_table` reads a local file (jsonl, json, parquet, csv, arrow) or a directory written
by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`; `open_hub` a dataset by Hub id
(fetched into the Hugging Face cache, or read from it offline). Either way the rows stay in an
Arrow file that the OS pages in on demand (`datasets` converts jsonl, json and csv into
its cache once), and `Rows` is a lazy sequence over them: indexing it converts one row to
a Python dict, so a million-row file costs its index array, not a million dicts.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from gpurl import hub
from gpurl.config import ConfigError

# One row as `datasets` gives it -> the row gpurl uses; `where` names it in errors.
Convert = Callable[[dict, str], dict]

# File suffix -> the `datasets` builder that reads it.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
            ".arrow": "arrow"}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # a dependency of gpurl; only a broken install lacks it
        raise ConfigError("reading data files needs the `datasets` package; run "
                          "pip install datasets.") from e
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def open_table(path_str: str | None, key: str, split: str = "train") -> Any:
    """The `datasets.Dataset` of a file or a `save_to_disk` directory (`split` picks one
    split of a saved DatasetDict)."""
    path = Path(path_str or "").expanduser()
    if not path_str or not path.exists():
        raise ConfigError(f"{key}={path_str} does not exist; point it to a data file "
                          f"({', '.join(BUILDERS)}) or a save_to_disk directory.")
    datasets = _datasets()
    if path.is_dir():
        try:
            table = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise ConfigError(f"{key}={path} is a directory but not one written by "
                              f"save_to_disk; point it to a data file or such a "
                              f"directory.") from e
        except Exception as e:  # noqa: BLE001 - a damaged save: pyarrow, json, datasets
            raise ConfigError(f"{key}={path} is a save_to_disk directory that cannot be read "
                              f"({_reason(e)}); save the dataset again or point {key} to "
                              f"another copy.") from None
        return _pick_split(table, split, key, path)
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(f"{key}={path} has the unknown suffix {path.suffix!r}; use one of "
                          f"{', '.join(BUILDERS)} or a save_to_disk directory.")
    if path.stat().st_size == 0:
        raise ConfigError(f"{path} has no rows; add some.")
    try:
        # CSV cells are text: pandas' type guessing would turn a completion " 5" into 5.
        options = {}
        if builder == "csv":
            with path.open(encoding="utf-8", newline="") as f:
                header = next(csv.reader(f), [])
            options = {"features": datasets.Features({n: datasets.Value("string") for n in header}),
                       "keep_default_na": False}
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as e:  # noqa: BLE001 - pyarrow, json, csv and datasets each raise their own
        raise ConfigError(f"{key}={path} is not a readable {path.suffix.lower()[1:]} file "
                          f"({_reason(e)}); write it again with the tool that made it, or "
                          f"convert it to jsonl.") from None


def _reason(error: BaseException) -> str:
    """The innermost cause of a reader's error: its first sentence, on one line, short."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = " ".join(str(error).split()).split(". ")[0].rstrip(".") or type(error).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def open_hub(name: str | None, split: str, subset: str | None, key: str = "data.dataset",
             local: str | None = None) -> Any:
    """Split `split` of dataset `name` (config `subset`): a Hub id (`org/name[@revision]`,
    fetched into the Hugging Face cache by `gpurl.hub` unless HF_HUB_OFFLINE=1) or a local
    directory laid out as a Hub dataset (data files, and a README.md naming its configs).
    `key` names the setting in errors, `local` their alternative to the Hub."""
    if not name:
        raise ConfigError(f"{key} is not set; set it to a Hub id (owner/name) or a local "
                          f"dataset directory.")
    source = hub.local_path(name, key, kind="dataset", local=local)
    datasets = _datasets()
    try:
        return datasets.load_dataset(source, subset, split=split)
    except ValueError as e:  # an unknown split or config
        raise ConfigError(f"{key}={name} has no split {split!r} or config {subset!r} "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); name a "
                          f"split and config it has.") from e
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise ConfigError(f"{key}={name} holds no data files `datasets` reads (parquet, arrow, "
                          f"json, jsonl, csv; {type(e).__name__}); "
                          f"{local or 'point data.path to its files'}.") from e


def _pick_split(table: Any, split: str, key: str, path: Path) -> Any:
    if not hasattr(table, "keys"):  # one Dataset
        return table
    if split not in table:
        raise ConfigError(f"{key}={path} holds the splits {', '.join(table)}, not {split!r}; "
                          f"set data.split to one of them.")
    return table[split]


def columns(table: Any) -> list[str]:
    return list(table.column_names)


class Rows(Sequence):
    """Rows `index` of `table`, each converted by `convert` when it is read."""

    def __init__(self, table: Any, convert: Convert, where: str, key_columns: list[str],
                 index: np.ndarray | None = None):
        self.table, self.convert, self.where = table, convert, where
        self.key_columns = key_columns  # the columns that identify a row's prompt
        self.index = np.arange(len(table)) if index is None else index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(self.index[i])
        j = int(self.index[i])
        return self.convert(self.table[j], f"{self.where} row {j + 1}")

    def __iter__(self) -> Iterator[dict]:
        for start in range(0, len(self.index), 1024):
            chunk = self.index[start:start + 1024]
            batch = self.table[chunk]  # one Arrow read per chunk
            for k, j in enumerate(chunk):
                yield self.convert({c: v[k] for c, v in batch.items()},
                                   f"{self.where} row {int(j) + 1}")

    def __eq__(self, other: object) -> bool:  # as a list of the converted rows
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal rows, different objects: unhashable

    def take(self, positions: np.ndarray) -> Rows:
        """The rows at `positions` (positions into this sequence, not into the table)."""
        return Rows(self.table, self.convert, self.where, self.key_columns,
                    self.index[np.asarray(positions, np.int64)])

    def keys(self) -> Iterator[str]:
        """Each row's prompt identity (its key columns' raw values), read a chunk at a time
        and converting no row."""
        for start in range(0, len(self.index), 8192):
            chunk = self.table.select_columns(self.key_columns)[self.index[start:start + 8192]]
            yield from map(repr, zip(*(chunk[c] for c in self.key_columns)))
