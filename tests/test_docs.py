"""The docs build from the code: docs/configuration.md is the rendering of gpurl/config.py's
field comments, and every link from README.md and docs/ to a file of the repository resolves."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gpurl.cli import config_docs
from gpurl.config import OptimConfig, RolloutConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current():
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == config_docs.render(), (
        "docs/configuration.md is stale (gpurl/config.py or configs/ changed); regenerate it "
        "with `python -m gpurl.cli.config_docs` and commit the result.")


def test_field_comments_are_the_docs():
    train = {d.key: d for d in config_docs.field_docs(TrainConfig)}
    assert train["steps"] == config_docs.FieldDoc("steps", "int", "300", "optimizer steps")
    assert list(train) == [f.name for f in dataclasses.fields(TrainConfig)]
    optim = {d.key: d for d in config_docs.field_docs(OptimConfig)}
    assert optim["freeze"].doc.startswith("regexes over parameter paths")  # comment block above
    assert optim["freeze"].default == "[]"
    rollout = {d.key: d for d in config_docs.field_docs(RolloutConfig)}
    # a comment block above the field, its doc
    assert rollout["mode"].doc.startswith("sync: each step samples, then trains; one_ahead")


def test_undocumented_field_is_an_error():
    source = "class Probe:\n    documented: int = 1  # a doc\n    bare: int = 2\n"

    @dataclasses.dataclass
    class Probe:
        documented: int = 1
        bare: int = 2

    with pytest.raises(ValueError, match="Probe.bare .* has no comment"):
        config_docs.field_docs(Probe, source)


@pytest.mark.slow
def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert config_docs.main(["--check", str(stale)]) == 1
    assert "python -m gpurl.cli.config_docs" in capsys.readouterr().err
    assert config_docs.main([str(stale)]) == 0
    assert config_docs.main(["--check", str(stale)]) == 0


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            outside = "://" in target or target.startswith("../")  # web, or beside the repo
            if not outside and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, f"broken links: {missing}"


def test_shipped_files_cite_only_what_ships():
    """Config comments, code and docs name files a user has: the development notes beside
    the repository (REAL_MODEL.md, /work/shared) are not shipped (issue 66)."""
    shipped = [*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "gpurl").rglob("*.py"),
               *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    citing = [str(p.relative_to(ROOT)) for p in shipped
              if re.search(r"REAL_MODEL\.md|/work/shared", p.read_text())]
    assert not citing, f"files citing notes that do not ship: {citing}"
