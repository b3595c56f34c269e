"""Every command line the docs show works as written: each `gpurl ...` and `srun ... gpurl
...` line in a fenced block of README.md and docs/*.md goes through `gpurl check` with the
process count its launcher implies (`srun -n`, `--ntasks`, `-N x --ntasks-per-node`, the
block's `#SBATCH` lines, a Hydra Slurm launcher's nodes x tasks; one device per process), or
else the one `distributed.num_processes` names (one device each) or `plan.devices` lays
out. A command for one process runs on one GPU or on a node of eight: it must start on one
of them.
Lines that only print (`--help`, `--cfg job`) start nothing and are left out.

The paths a command names (checkpoints, data files, run directories) stand for the user's
files: the test makes each one exist under a temporary directory (a run directory holding a
config.yaml) and points the command there. Shell variables read as 0; `...` (the rest of a
command line) is left out. Reward functions, environments and agents a doc writes as user
code (`my_pkg....`) are the docs' own Python blocks (`class Maze`, `def lookup`, `async def
solve`) written into a package, beside reward functions of the documented signature.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpurl import hub
from gpurl.cli import main, validate
from gpurl.config.dicts import to_dict

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("train", "plan", "eval", "generate", "serve")


def _row(i: int) -> dict:
    """A data row every documented layout reads (prompt/completion, pairs, GSM8K, MATH, suites)."""
    q = f"What is {i}+1?"
    return {"prompt": q, "completion": f" {i + 1}", "chosen": f" {i + 1}", "rejected": f" {i}",
            "question": q, "answer": f"{i}+1={i + 1}\n#### {i + 1}", "problem": q,
            "solution": f"\\boxed{{{i + 1}}}"}



# keys whose values are the user's files: (kind) file, dir, or a gpurl run directory
PATH_KEYS = {"model.checkpoint": "model", "algo.teacher": "model", "algo.reward_model": "dir",
             "data.path": "file", "data.eval_path": "file", "prompts_file": "file",
             "suite_path": "file",
             "checkpoint": "run", "record": None, "out": None}


INFO_FLAGS = ("--help", "-h", "--cfg", "-c", "--info", "-i", "--hydra-help")


def _launch_count(prefix: list[str], sbatch: dict[str, int]) -> int | None:
    """Processes an `srun` prefix (and the block's #SBATCH lines) starts; None without srun."""
    if "srun" not in prefix:
        return None
    opts = dict(sbatch)
    args = prefix[prefix.index("srun") + 1:]
    for i, a in enumerate(args):
        key, _, value = a.partition("=")
        if not value and i + 1 < len(args) and key in ("-n", "-N", "--ntasks", "--nodes",
                                                      "--ntasks-per-node"):
            value = args[i + 1]
        if re.fullmatch(r"-[nN]\d+", a):
            key, value = a[:2], a[2:]
        if value.isdigit():
            opts[{"-n": "ntasks", "--ntasks": "ntasks", "-N": "nodes", "--nodes": "nodes",
                  "--ntasks-per-node": "ntasks-per-node"}.get(key, key)] = int(value)
    if "ntasks" in opts:
        return opts["ntasks"]
    return opts.get("nodes", 1) * opts.get("ntasks-per-node", 1)


def _hydra_slurm(args: list[str]) -> int | None:
    """Processes per job of a sweep on Hydra's Slurm launcher (nodes x tasks per node)."""
    if "hydra/launcher=slurm" not in args:
        return None
    values = dict(a.partition("=")[::2] for a in args)
    return (int(values.get("hydra.launcher.nodes", 1))
            * int(values.get("hydra.launcher.tasks_per_node", 1)))


def _sbatch(lines: list[str]) -> dict[str, int]:
    opts = {}
    for line in lines:
        for key, value in re.findall(r"--(nodes|ntasks|ntasks-per-node)[= ](\d+)", line):
            opts[key] = int(value)
        for key, value in re.findall(r"#SBATCH\s+-([nN])\s*(\d+)", line):
            opts["ntasks" if key == "n" else "nodes"] = int(value)
    return opts


def documented_commands() -> list[tuple[str, list[str], int | None]]:
    """(where, gpurl arguments, processes) of every command line in a fenced block."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        blocks, block, start = [], None, 0
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                if block is None:
                    block, start = [], number
                else:
                    blocks.append((start, block))
                    block = None
            elif block is not None:
                block.append((number, line))
        for _, body in blocks:
            sbatch = _sbatch([text for _, text in body if "#SBATCH" in text])
            joined, pending = [], None
            for number, text in body:
                if pending is not None:
                    pending = (pending[0], pending[1] + " " + text.strip())
                else:
                    pending = (number, text.strip())
                if pending[1].endswith("\\"):
                    pending = (pending[0], pending[1][:-1])
                    continue
                joined.append(pending)
                pending = None
            for number, text in joined:
                text = re.sub(r"^\$ ", "", text)
                text = re.sub(r"\$\(\([^)]*\)\)|\$\{?\w+\}?", "0", text)  # shell variables
                try:
                    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
                    lexer.whitespace_split, lexer.commenters = True, "#"
                    tokens = list(lexer)
                except ValueError:
                    continue
                at = next((i for i, t in enumerate(tokens)
                           if t == "gpurl" or t.endswith("/gpurl")), None)
                if at is None or at + 1 >= len(tokens) or tokens[at + 1] not in COMMANDS + ("check",):
                    continue
                rest = []
                for t in tokens[at + 1:]:
                    if t in (";", "&", "&&", "|", "||", ")", "done"):
                        break
                    rest.append(t)
                if rest[0] == "check":
                    rest = rest[1:]
                rest = [t for t in rest if t != "..." and t != "\u2026"]
                if any(t in INFO_FLAGS for t in rest):
                    continue
                where = f"{doc.relative_to(ROOT)}:{number}"
                found.append((where, rest, _launch_count(tokens[:at], sbatch) or _hydra_slurm(rest)))
    return found


def _user_paths(args: list[str], tmp: Path, run_config: str) -> list[str]:
    """`args` with every path key pointed at a file of that kind made under `tmp`."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        kind = PATH_KEYS.get(key.lstrip("+"), "absent")
        if not sep or kind == "absent" or value in ("null", "") or (
                kind in ("model", "dir") and hub.is_hub_id(value)):  # a Hub id stays one
            out.append(arg)
            continue
        path = tmp / "user" / value.lstrip("/~")
        if kind in ("file", None) or (kind == "model" and value.endswith(".gguf")):
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "file":  # rows a start reads (`gpurl check` reads them as it does)
                path.write_text("".join(json.dumps(_row(i)) + "\n" for i in range(300)))
        elif kind in ("dir", "model"):
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "run":
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.yaml").write_text(run_config)
        out.append(f"{key}={path}")
    return out


COMMAND_LINES = documented_commands()


def test_the_docs_show_commands():
    """The extraction finds the docs' commands (a change of fence or prompt style would
    otherwise leave the next test with nothing to check)."""
    assert len(COMMAND_LINES) >= 40
    assert any((n or 0) >= 8 for _, _, n in COMMAND_LINES)  # the multi-process examples
    assert {args[0] for _, args, _ in COMMAND_LINES} >= {"train", "eval", "generate", "plan"}


def _python_block(defines: str) -> str:
    """The docs' Python block that defines `defines` (e.g. "class Maze")."""
    for doc in DOCS:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            if defines in block:
                return block
    raise AssertionError(f"no Python block of the docs defines {defines!r}")


def _user_package(tmp: Path) -> None:
    """my_pkg as the docs tell users to write it."""
    pkg = tmp / "user_code" / "my_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(_python_block("class Maze"))
    (pkg / "tools.py").write_text(_python_block("def lookup"))
    (pkg / "agents.py").write_text(_python_block("async def solve"))
    (pkg / "rewards.py").write_text(
        "def fmt(prompts, completions, **metadata):\n"
        "    return [float(c.strip().endswith('.')) for c in completions]\n\n\ncorrect = fmt\n")


def _check(argv: list[str], capsys) -> str | None:
    """`gpurl check ARGV` in this process: None when it passes, else its last line."""
    try:
        main(argv)
    except SystemExit as e:
        out = capsys.readouterr()
        if e.code:
            return (out.err.strip().splitlines() or ["?"])[-1]
    capsys.readouterr()
    return None


@pytest.mark.slow
def test_every_documented_command_passes_gpurl_check(tmp_path, capsys, monkeypatch):
    """Hub ids (model presets' hub_id, model.checkpoint=org/name, data.dataset) are checked
    as on an online machine with an empty cache: `gpurl check` reads the cache only."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.chdir(tmp_path)
    _user_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "user_code"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # PYTHONPATH=examples gpurl ...
    run_config = yaml.safe_dump(to_dict(validate(["model=tiny"])), sort_keys=False)
    failures = []
    for where, args, processes in COMMAND_LINES:
        argv = ["check", args[0], *_user_paths(args[1:], tmp_path, run_config)]
        if processes is not None:
            errors = [_check([*argv, f"processes={processes}", "devices=1"], capsys)]
        elif any(a.startswith(("plan.devices=", "distributed.num_processes=")) for a in args):
            errors = [_check(argv + ["devices=1"] * (args[0] != "plan"), capsys)]
        elif where.startswith("docs/distributed.md"):  # a node of eight, as the page says
            errors = [_check([*argv, "devices=8"], capsys)]
        else:  # one GPU, or else a node of eight
            errors = [_check([*argv, "devices=1"], capsys)]
            errors += [_check([*argv, "devices=8"], capsys)] if errors[0] else []
        if all(errors):
            failures.append(f"{where}: gpurl {' '.join(args)} [{processes or 1} process(es)] "
                            f"-> {' / '.join(errors)}")
    assert not failures, "documented commands that would stop at start-up:\n" + "\n".join(failures)
