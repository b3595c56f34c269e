"""The configuration reference, generated from the code: `docs/configuration.md`.

Every field of the dataclasses in `gpurl/config/` carries a comment, which is its
documentation: the comment after the field on its line, or else the comment lines just
above it. This module reads them from the source (`ast` for the fields, `tokenize` for the
comments), adds each field's type and default, and lists every config group's options
from `configs/` with the first lines of their header comments.

    python -m gpurl.cli.config_docs            # (re)write docs/configuration.md
    python -m gpurl.cli.config_docs --check    # exit 1 when the file differs from the code

`tests/test_docs.py` fails when docs/configuration.md is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

import yaml

from gpurl.algorithms import registry
from gpurl.cli.compose import config_dir
from gpurl.config import AlgoConfig, Config, EvalConfig, GenerateConfig, ServeConfig
from gpurl.config.dicts import MOVED_KEYS, REPLACED_KEYS, REWARDS_SHORTHAND, yaml_key

DOC_PATH = Path("docs/configuration.md")
REGENERATE = "python -m gpurl.cli.config_docs"


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str  # as written in YAML and on the command line
    type: str  # the annotation as written in the source
    default: str  # YAML spelling of the dataclass default
    doc: str  # the field's comment


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Comment text by line number, and the lines that hold only a comment."""
    text, alone = {}, set()
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            text[line] = tok.string.lstrip("#").strip()
            if lines[line - 1].lstrip().startswith("#"):
                alone.add(line)
    return text, alone


def _field_comment(node: ast.AnnAssign, text: dict[int, str], alone: set[int]) -> str:
    """The comment on the field's own lines, else the comment block right above it."""
    own = [text[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
           if n in text and n not in alone]
    if own:
        return " ".join(own)
    above, line = [], node.lineno - 1
    while line in alone:
        above.insert(0, text[line])
        line -= 1
    return " ".join(above)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        plain = (list(value) if isinstance(value, tuple) else
                 {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
                 if isinstance(value, dict) else value)
        return yaml.safe_dump(plain, default_flow_style=True, width=10**6).strip()
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def field_docs(cls: type, source: str | None = None, own: bool = False) -> list[FieldDoc]:
    """The documented keys of one config dataclass in source order (groups, i.e. nested
    dataclasses, have sections of their own); raises ValueError naming any undocumented key.
    `source` is the module text that defines `cls` (default: the file of its module, e.g.
    gpurl/config/run.py); `own`: only the keys `cls` adds to its bases (not those whose default
    it changes)."""
    if source is None:
        source = Path(sys.modules[cls.__module__].__file__).read_text()
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    text, alone = _comments(source)
    _, groups = _dataclass_fields(cls)
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                 for f in dataclasses.fields(base)} if own else set()
    fields = {f.name: f for f in dataclasses.fields(cls)
              if f.name not in groups and f.name not in inherited}
    out = []
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and item.target.id in fields):
            continue
        name = item.target.id
        doc = _field_comment(item, text, alone)
        if not doc:
            raise ValueError(f"{cls.__name__}.{name} in gpurl/config/ has no comment; "
                             f"document it with a comment after the field.")
        out.append(FieldDoc(yaml_key(name), ast.get_source_segment(source, item.annotation) or "",
                            _yaml_value(_default(fields[name])), doc))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(prefix: str, docs: list[FieldDoc]) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{prefix}{d.key}` | `{_cell(d.type)}` | `{_cell(d.default)}` | {_cell(d.doc)} |"
             for d in docs]
    return rows


def _header_comment(path: Path) -> str:
    """The first sentence of a YAML option file's leading comment block."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    # A sentence ends at ". " before a letter; the first 20 characters are skipped so
    # that "Dr. GRPO" or "et al. 2025" do not end it.
    end = re.search(r"\.\s+(?=[A-Za-z`])", text[20:])
    return text if end is None else text[:20 + end.start() + 1]


def _main_job_options(configs: Path) -> dict[str, str]:
    """group -> the option `gpurl train` picks (the defaults list of configs/config.yaml)."""
    defaults = yaml.safe_load((configs / "config.yaml").read_text()).get("defaults", [])
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}


def _group_section(group: str, cls: type, configs: Path, chosen: dict[str, str]) -> list[str]:
    lines = [f"## `{group}`", ""]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        lines += [" ".join(cls.__doc__.split()), ""]
    options = sorted((configs / group).glob("*.yaml")) if (configs / group).is_dir() else []
    if options:
        lines += [f"Options (`{group}=NAME`; `gpurl train` uses `{chosen.get(group, '-')}`):", ""]
        for path in options:
            about = _header_comment(path)
            lines.append(f"- `{path.stem}`" + (f": {about}" if about else ""))
        lines.append("")
    lines += _table(f"{group}.", field_docs(cls)) + [""]
    if cls is AlgoConfig:
        lines += _algo_schemas()
    for name, sub in _dataclass_fields(cls)[0]:  # a group inside the group (model.lora)
        lines += [f"### `{group}.{name}`", ""]
        if sub.__doc__ and not sub.__doc__.startswith(sub.__name__ + "("):
            lines += [" ".join(sub.__doc__.split()), ""]
        lines += _table(f"{group}.{name}.", field_docs(sub)) + [""]
    return lines


def _algo_schemas() -> list[str]:
    """A section per algorithm schema and part of one (PPO's critic), each listing the
    keys it adds and the algorithms that have them."""
    parts = list(dict.fromkeys(c for schema in registry.schemas() for c in reversed(schema.__mro__)
                               if dataclasses.is_dataclass(c) and c is not AlgoConfig))
    lines = []
    for part in parts:
        users = [a.name for a in registry.ALGORITHMS.values() if issubclass(a.config, part)]
        lines += [f"### `{part.__name__}` (algo={', '.join(users)})", ""]
        if part.__doc__ and not part.__doc__.startswith(part.__name__ + "("):
            lines += [" ".join(part.__doc__.split()), ""]
        docs = field_docs(part, own=True)
        lines += (_table("algo.", docs) if docs else ["No keys beyond `algo.name`."]) + [""]
    return lines


def _dataclass_fields(cls: type) -> tuple[list[tuple[str, type]], set[str]]:
    hints = typing.get_type_hints(cls)
    groups = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)
              if dataclasses.is_dataclass(hints[f.name])]
    return groups, {name for name, _ in groups}


def render(configs: Path | None = None) -> str:
    """The whole of docs/configuration.md."""
    configs = configs or config_dir()
    chosen = _main_job_options(configs)
    groups, _ = _dataclass_fields(Config)
    top = field_docs(Config)
    lines = [
        f"<!-- Generated from gpurl/config/ and configs/ by `{REGENERATE}`; do not edit. -->",
        "", "# Configuration reference", "",
        "Every key of `gpurl train`, its type, its default in the schema and its meaning (the "
        "comment on the field in `gpurl/config/`). A group option (`algo=grpo`, `train=rl`, "
        "...) is a YAML file in `configs/<group>/` that sets some of these keys; "
        "`gpurl train --cfg job` prints the values a command line composes to. Set any key "
        "on the command line: `gpurl train algo=gspo optim.lr=3e-6 'rewards=[numeric_match]'`.",
        "", "Groups: " + ", ".join(f"[`{g}`](#{g})" for g, _ in groups)
        + (", and the [top-level keys](#top-level-keys)." if top else "."), ""]
    for name, cls in groups:
        lines += _group_section(name, cls, configs, chosen)
    if top:
        lines += ["## Top-level keys", ""] + _table("", top) + [""]
    lines += ["## Moved keys", "", "Old names that still work, on the command line (with a "
              "one-line notice) and in the config.yaml of older run directories:", ""]
    lines += [f"- `{old}`: now `{new}`" for old, new in MOVED_KEYS.items()]
    lines += [f"- `{REWARDS_SHORTHAND[0]}=[...]` (a list) is short for "
              f"`{REWARDS_SHORTHAND[1]}=[...]`", "",
              "Keys replaced by a choice: the command line refuses them with a sentence naming "
              "the choice; the config.yaml of older run directories is read as that choice.", ""]
    lines += [f"- `{old}=true`: now `{new}={values[True]}`"
              for old, (new, values) in REPLACED_KEYS.items()] + [""]
    for command, cls in (("generate", GenerateConfig), ("eval", EvalConfig), ("serve", ServeConfig)):
        sub_groups, _ = _dataclass_fields(cls)
        lines += [f"## `gpurl {command}`", "", " ".join((cls.__doc__ or "").split()), "",
                  "Uses the groups " + ", ".join(f"`{g}`" for g, _ in sub_groups)
                  + " as above, and these keys:", ""] + _table("", field_docs(cls)) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    out = Path(paths[0]) if paths else DOC_PATH
    text = render()
    if check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale; regenerate it with `{REGENERATE}`.", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
