"""`gpurl export`: a trained run -> HF directory that transformers loads with the same
logits, and the exported tokenizer encodes like gpurl's."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import TINY_MODEL, make_config
from gpurl.models import model_spec
from gpurl.models.loading import load_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.loop import train
from gpurl.train.optim import make_optimizer
from gpurl.train.step import placement
from gpurl.distributed.mesh import trainer_mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    cfg = make_config(model=dict(TINY_MODEL, tokenizer="bytes"), logger={"progress": False},
                      data={"max_len": 24, "num_train": 32, "num_eval": 0},
                      train={"steps": 3, "batch_size": 8, "checkpoint_every": 0},
                      run={"dir": str(run)})
    train(cfg)
    return run, cfg


def test_export_cli_round_trip_through_transformers(trained_run, tmp_path):
    run, cfg = trained_run
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "gpurl.cli", "export", f"checkpoint={run}",
                           f"out={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, trainer_mesh(cfg.mesh), cfg.mesh.train_rules)
    state, _ = Checkpointer(run / "checkpoints", 2).restore(3, place.abstract_state, place.state)

    text = "12 + 7 = 19"
    ids = load_tokenizer(cfg.model).encode(text)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    tokens = jnp.asarray([[2] + ids], jnp.int32)
    t = tokens.shape[1]
    ours = jax.jit(spec.apply)(state.params, tokens, jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def test_export_errors_are_one_sentence(trained_run, tmp_path):
    run, _ = trained_run
    for args, expected in [
        ([f"checkpoint={tmp_path}", f"out={tmp_path}/x"], "holds no config.yaml"),
        ([f"checkpoint={run}", f"out={tmp_path}/x", "step=7"], "has no checkpoint at step 7"),
        ([f"checkpoint={run}"], "gpurl export needs out=..."),
        ([f"ckpt={run}"], "is not an argument of gpurl export"),
    ]:
        done = subprocess.run([sys.executable, "-m", "gpurl.cli", "export", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
