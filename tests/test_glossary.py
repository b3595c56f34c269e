"""Every array name in gpurl/ follows the shape-letter glossary (`gpurl.glossary`): its
suffix letters are defined there, each once, or, for a letter one module alone uses, in
that module's docstring."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

from gpurl import glossary

ROOT = Path(__file__).resolve().parents[1] / "gpurl"
# a lowercase name, then _ and axes joined by x: logits_BxTxV, r_PxG, last_Bx1, states_BxN1xD
SUFFIXED = re.compile(r"^[a-z][a-z0-9_]*?_((?:[A-Z][0-9]?|[0-9]+)(?:x(?:[A-Z][0-9]?|[0-9]+))*)$")


# a module's own letter: a docstring line "Shape letter R: rotary frequencies (E / 2)."
DECLARED = re.compile(r"^\s*Shape letter ([A-Z]): (.+)$", re.MULTILINE)


def _names(path: Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def _declared(path: Path) -> dict[str, str]:
    """The letters a module declares for itself in its docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return dict(DECLARED.findall(doc))


def _letters(path: Path) -> set[str]:
    """The shape letters of the array names in a module."""
    out = set()
    for name in _names(path):
        match = SUFFIXED.match(name)
        if match:
            out |= {axis[0] for axis in match.group(1).split("x") if not axis.isdigit()}
    return out


def _usage(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(modules using each letter, letters each module declares)."""
    used, declared = defaultdict(set), {}
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root))
        declared[module] = set(_declared(path))
        for letter in _letters(path):
            used[letter].add(module)
    return used, declared


def undeclared(root: Path = ROOT) -> dict[str, list[str]]:
    """Modules whose array names use a letter neither the glossary nor their own docstring
    defines, and glossary letters a module redefines."""
    used, declared = _usage(root)
    out: dict[str, list[str]] = {}
    for letter, modules in used.items():
        for module in modules:
            if letter not in glossary.LETTERS and letter not in declared[module]:
                out.setdefault(module, []).append(letter)
    for module, letters in declared.items():
        for letter in letters & set(glossary.LETTERS):
            out.setdefault(module, []).append(f"{letter} (redefines the glossary's)")
    return out


def test_every_shape_suffix_uses_glossary_letters_or_its_modules_own():
    assert not undeclared(), f"shape letters defined nowhere: {undeclared()}"


def test_the_glossary_keeps_the_letters_several_modules_use():
    """A glossary letter serves several modules; one that a single module uses belongs in
    that module's docstring, and a module's own letter stays its own."""
    used, declared = _usage(ROOT)
    single = sorted(letter for letter in glossary.LETTERS if len(used[letter]) < 2)
    assert not single, f"glossary letters used by one module or none: {single}"
    shared = sorted(f"{letter} in {sorted(used[letter])}" for letters in declared.values()
                    for letter in letters if len(used[letter]) > 1)
    assert not shared, f"a module's own letter used elsewhere; move it to the glossary: {shared}"


def test_an_undeclared_letter_fails(tmp_path):
    """The check itself: a name with a letter nothing defines is reported, and its
    module's declaration makes it pass."""
    module = tmp_path / "mod.py"
    module.write_text('"""A module."""\n\nweights_QxR = None\n')
    assert undeclared(tmp_path) == {"mod.py": ["R"]}
    module.write_text('"""A module.\n\nShape letter R: rotary frequencies.\n"""\n\nweights_QxR = None\n')
    assert undeclared(tmp_path) == {}


def test_glossary_docstring_lists_each_letter_once():
    lines = [line.split() for line in glossary.__doc__.splitlines()]
    listed = [words[0] for words in lines if words and len(words[0]) == 1 and words[0].isupper()]
    assert listed == list(glossary.LETTERS)
    assert len(set(listed)) == len(listed)
