"""Every array name in gpurl/ follows the shape-letter glossary (`gpurl.glossary`): its
suffix letters are defined there, each once."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from gpurl import glossary

ROOT = Path(__file__).resolve().parents[1] / "gpurl"
# a lowercase name, then _ and axes joined by x: logits_BxTxV, r_PxG, last_Bx1, states_BxN1xD
SUFFIXED = re.compile(r"^[a-z][a-z0-9_]*?_((?:[A-Z][0-9]?|[0-9]+)(?:x(?:[A-Z][0-9]?|[0-9]+))*)$")


def _names(path: Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_every_shape_suffix_uses_glossary_letters():
    unknown = {}
    for path in sorted(ROOT.rglob("*.py")):
        for name in _names(path):
            match = SUFFIXED.match(name)
            if not match:
                continue
            letters = {axis[0] for axis in match.group(1).split("x") if not axis.isdigit()}
            extra = letters - set(glossary.LETTERS)
            if extra:
                unknown.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert not unknown, f"shape letters outside gpurl/glossary.py: {unknown}"


def test_glossary_docstring_lists_each_letter_once():
    lines = [line.split() for line in glossary.__doc__.splitlines()]
    listed = [words[0] for words in lines if words and len(words[0]) == 1 and words[0].isupper()]
    assert listed == list(glossary.LETTERS)
    assert len(set(listed)) == len(listed)
