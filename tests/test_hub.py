"""Hugging Face Hub ids (`org/name[@revision]`) for the model, a teacher, a reward model
and `data=hf`: resolved offline from a cache laid out as huggingface_hub writes it,
downloaded from a Hub on 127.0.0.1 by one of two processes (the other waits and reads the
same files), and every failure one sentence. No test reaches the network (conftest sets
HF_HUB_OFFLINE=1 and an empty HF_HOME)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpurl import hub
from gpurl.algorithms import registry
from gpurl.cli import main
from gpurl.train.loop import _pinned
from gpurl.config import ConfigError, DataConfig, ModelConfig
from gpurl.data.sources import load_prompts
from gpurl.models import loading
from gpurl.models.hf_export import export_hf
from gpurl.models.spec import model_spec
from gpurl.models.tokenizer import byte_tokenizer
from gpurl.train.weights import reward_model_spec, teacher_config
from conftest import make_config, xla_flags
from hub_server import HubServer, Repo, commit_id, files_of, lay_out_cache

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(name="tiny", init="random", num_layers=2)


def _model_files(tmp: Path, num_layers: int) -> dict[str, bytes]:
    """A tiny HF checkpoint (config, safetensors, tokenizer) of `num_layers` layers, and a
    README that no model download should fetch."""
    cfg = dataclasses.replace(TINY, num_layers=num_layers)
    out = tmp / f"export{num_layers}"
    export_hf(model_spec(cfg).init(num_layers), cfg, out)
    byte_tokenizer().tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (out / "README.md").write_text("# not read by gpurl\n")
    (out / "optimizer.pt").write_bytes(b"\0" * 64)
    return files_of(out)


def _model_repo(tmp: Path) -> Repo:
    """main: 2 layers; tag v1: 1 layer (the revision that loaded shows in the config)."""
    main, v1 = _model_files(tmp, 2), _model_files(tmp, 1)
    return Repo({commit_id(main): main, commit_id(v1): v1},
                {"main": commit_id(main), "v1": commit_id(v1)})


def _parquet(rows: list[dict]) -> bytes:
    import datasets
    buffer = io.BytesIO()
    datasets.Dataset.from_list(rows).to_parquet(buffer)
    return buffer.getvalue()


CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
---
# sums
"""


def _dataset_repo() -> Repo:
    """GSM8K's layout (a card naming config `main`, parquet per split); v1 has other rows."""
    commits, refs = {}, {}
    for ref, offset in (("main", 0), ("v1", 100)):
        rows = [{"question": f"{offset + i} + 1 =", "answer": f"#### {offset + i + 1}"}
                for i in range(6)]
        files = {"README.md": CARD.encode(),
                 "main/train-00000-of-00001.parquet": _parquet(rows[:4]),
                 "main/test-00000-of-00001.parquet": _parquet(rows[4:])}
        commits[commit_id(files)], refs[ref] = files, commit_id(files)
    return Repo(commits, refs)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Repo]:
    tmp = tmp_path_factory.mktemp("repos")
    return {("model", "acme/tiny"): _model_repo(tmp), ("dataset", "acme/sums"): _dataset_repo()}


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub._snapshot.cache_clear()
    return tmp_path / "hf"


@pytest.mark.slow  # a tiny export and `datasets` (4 s)
def test_hub_ids_resolve_offline_from_the_cache(repos, hf_home: Path, capsys) -> None:
    """org/name, org/name@tag and org/name@commit, for the model, a teacher, a reward
    model's backbone and data=hf, with HF_HUB_OFFLINE=1 and the files in the cache only."""
    model = repos[("model", "acme/tiny")]
    for (kind, repo_id), repo in repos.items():
        lay_out_cache(hf_home / "hub", kind, repo_id, repo)
    cfg = dataclasses.replace(TINY, init="checkpoint")
    for checkpoint, layers in (("acme/tiny", 2), ("acme/tiny@v1", 1),
                               (f"acme/tiny@{model.refs['v1']}", 1)):
        resolved = loading.resolve(dataclasses.replace(cfg, checkpoint=checkpoint))
        assert resolved.num_layers == layers, checkpoint
    path = loading.checkpoint_path(dataclasses.replace(cfg, checkpoint="acme/tiny"))
    assert Path(path) == hf_home / "hub/models--acme--tiny/snapshots" / model.refs["main"]
    assert loading.load_tokenizer(dataclasses.replace(cfg, checkpoint="acme/tiny")).eos_id == 1
    # A preset's hub_id stands in for model.checkpoint.
    assert loading.resolve(dataclasses.replace(cfg, hub_id="acme/tiny@v1")).num_layers == 1

    opd = registry.get("opd").config(name="opd", teacher="acme/tiny@v1")
    assert teacher_config(opd, TINY).num_layers == 1
    assert reward_model_spec("acme/tiny", TINY).cfg.num_layers == 2

    data = DataConfig(name="hf", dataset="acme/sums", subset="main", split="train",
                      eval_split="test", prompt_key="question")
    train, held_out = load_prompts(data)
    assert [r["prompt"] for r in train] == [f"{i} + 1 =" for i in range(4)]
    assert [r["answer"] for r in held_out] == ["#### 5", "#### 6"]
    train, _ = load_prompts(dataclasses.replace(data, dataset="acme/sums@v1"))
    assert train[0]["prompt"] == "100 + 1 ="
    # data=gsm8k reads its preset's Hub dataset when data.path is null
    train, held_out = load_prompts(dataclasses.replace(data, name="gsm8k", prompt_key="prompt"))
    assert train[0]["prompt"] == "Question: 0 + 1 =\nAnswer:" and held_out[0]["answer"] == "5"

    # `gpurl check` reads the cache and fetches nothing
    main(["check", "train", "model=tiny", "model.init=checkpoint",
          "model.checkpoint=acme/tiny@v1", "data=hf", "data.dataset=acme/sums", "data.subset=main",
          "data.prompt_key=question", "data.num_eval=1"])  # (rows read as a start reads them)
    out = "".join(capsys.readouterr())
    assert "check passed" in out and f"weights acme/tiny@v1 (Hub id, cached: {hf_home}" in out
    assert "data.dataset: acme/sums (Hub id, cached" in out

    # A run pins every Hub id to its commit (config.yaml then names what it loaded).
    run = _pinned(make_config(model={"checkpoint": "acme/tiny@v1", "init": "checkpoint"},
                              algo={"name": "opd", "teacher": "acme/tiny"},
                              data={"name": "hf", "dataset": "acme/sums", "subset": "main"}))
    assert (run.model.checkpoint, run.algo.teacher, run.data.dataset) == (
        f"acme/tiny@{model.refs['v1']}", f"acme/tiny@{model.refs['main']}",
        f"acme/sums@{repos[('dataset', 'acme/sums')].refs['main']}")

    # A local directory named like an id is a path, never a Hub id.
    local = hf_home / "acme" / "tiny"
    local.mkdir(parents=True)
    assert not hub.is_hub_id(str(local)) and hub.is_hub_id("acme/tiny@v1")
    assert not hub.is_hub_id("models/tiny.gguf") and not hub.is_hub_id("/abs/dir")


def _one_sentence(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text.endswith(".") and text.count("; ") == 1, text
    return text


def test_each_hub_failure_is_one_sentence(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline and not cached; then against a Hub on 127.0.0.1: gated without a token, a
    revision the repository lacks, a repository that does not exist."""
    cfg = dataclasses.replace(TINY, init="checkpoint", checkpoint="acme/tiny")
    with pytest.raises(ConfigError) as e:
        loading.resolve(cfg)
    assert "is not in the Hugging Face cache" in _one_sentence(e) and "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_prompts(DataConfig(name="hf", dataset="nobody/no-such-gpurl-dataset"))
    assert "data.dataset=nobody/no-such-gpurl-dataset is not in the Hugging Face cache" in _one_sentence(e)

    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(hf_home / "no-token"))
    files = {"config.json": b"{}", "model.safetensors": b"\0" * 8}
    tiny = Repo({commit_id(files): files}, {"main": commit_id(files)})
    gated = dataclasses.replace(tiny, gated=True)
    with HubServer({("model", "acme/tiny"): tiny, ("model", "acme/gated"): gated}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        cases = {"acme/gated": "is gated on the Hugging Face Hub; accept its terms at "
                               "https://huggingface.co/acme/gated and set HF_TOKEN",
                 "acme/tiny@v9": "acme/tiny has no revision 'v9' on the Hub",
                 "acme/nothing": "is neither a local path nor a model on the Hugging Face Hub"}
        for checkpoint, fragment in cases.items():
            with pytest.raises(ConfigError) as e:
                loading.resolve(dataclasses.replace(cfg, checkpoint=checkpoint))
            assert fragment in _one_sentence(e), checkpoint
        opd = registry.get("opd").config(name="opd", teacher="acme/tiny@v9")
        with pytest.raises(ConfigError, match=r"^algo.teacher=acme/tiny@v9: acme/tiny has no rev"):
            teacher_config(opd, TINY)
        assert server.downloads("model.safetensors") == 0


SCRIPT = """
import sys
from gpurl.config import ModelConfig
from gpurl.models import loading, model_spec
cfg = loading.resolve(ModelConfig(name="tiny", checkpoint="acme/tiny@v1", init="checkpoint"))
spec = model_spec(cfg)
import jax, numpy as np
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
params = loading.load_params(cfg, spec, jax.tree.map(lambda _: one, spec.abstract_params))
total = sum(float(np.abs(np.asarray(x, np.float64)).sum()) for x in jax.tree.leaves(params))
print(cfg.num_layers, loading.load_tokenizer(cfg).vocab_size, f"{total:.6f}")
"""


@pytest.mark.slow
def test_two_processes_one_download_both_load(repos, tmp_path: Path) -> None:
    """Two processes started together against a Hub on 127.0.0.1 (HF_ENDPOINT): one fetches
    each file once, the other waits for it and loads the same weights; only the files gpurl
    reads are fetched."""
    with HubServer(repos) as server:
        # the architecture and the tokenizer need no weights (`gpurl plan` fetches none)
        with pytest.MonkeyPatch.context() as patch:
            import huggingface_hub.constants
            patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
            patch.setenv("HF_HUB_OFFLINE", "0")
            patch.setenv("HF_ENDPOINT", server.url)
            patch.setenv("HF_HOME", str(tmp_path / "planning"))
            hub._snapshot.cache_clear()
            cfg = loading.resolve(dataclasses.replace(TINY, init="checkpoint",
                                                      checkpoint="acme/tiny"))
            assert cfg.num_layers == 2 and loading.load_tokenizer(cfg).eos_id == 1
            assert server.downloads("config.json") == 1
            assert server.downloads("model.safetensors") == 0
        server.requests.clear()
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
               "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT),
               "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(None)}
        env.pop("HF_TOKEN", None)
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.strip().splitlines()[-1] for out, _ in outs]
    assert lines[0] == lines[1] and lines[0].startswith("1 259 "), lines
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert server.downloads(name) == 1, (name, server.requests)
    assert server.downloads("README.md") == server.downloads("optimizer.pt") == 0
    # one process asked for the revision twice (the config and tokenizer files, then the
    # weights); the waiting one asked nothing
    revision_calls = [p for m, p in server.requests if "/revision/" in p]
    assert len(revision_calls) == 2, server.requests
    fetched = [e for _, e in outs if "fetching from the Hugging Face Hub" in e]
    assert len(fetched) == 1


@pytest.mark.slow  # a tiny export, a loopback Hub and `hf download` (docs/offline.md)
def test_the_offline_recipe_fills_a_cache_that_an_offline_check_reads(repos, tmp_path: Path,
                                                                      capsys) -> None:
    """docs/offline.md, step 1 (`hf download` of the model and the dataset on a machine that
    reaches the Hub, here 127.0.0.1) then step 2 (`gpurl check` with HF_HUB_OFFLINE=1 on the
    filled cache): every Hub id reads as cached, and the rows are read."""
    cache = tmp_path / "shared"
    with HubServer(repos) as server:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
               "HF_HOME": str(cache)}
        hf = Path(sys.executable).parent / "hf"
        for args in (["acme/tiny", "--include", "*.json", "--include", "*.safetensors"],
                     ["acme/sums", "--repo-type", "dataset"]):
            done = subprocess.run([str(hf), "download", *args], env=env, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr
    assert server.downloads("optimizer.pt") == 0  # --include keeps it out
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        hub._snapshot.cache_clear()
        main(["check", "train", "model=tiny", "model.init=checkpoint", "model.checkpoint=acme/tiny",
              "data=hf", "data.dataset=acme/sums", "data.subset=main", "data.num_eval=1",
              "data.prompt_key=question"])
    out = "".join(capsys.readouterr())
    assert f"weights acme/tiny (Hub id, cached: {cache}" in out, out
    assert "data.dataset: acme/sums (Hub id, cached" in out and "data: 3 training rows, 1 held out" in out
