"""`gpurl plan plan.target=...`: every program of a run compiled by XLA's GPU compiler for
compile-only GPUs of a known kind (`gpurl.plan.targets`) on this CPU machine, with
the GPU's choices (cuDNN attention on Ampere and newer, Pallas kernels compiled by Triton,
bf16), and the memory a GPU of that kind would give it. The compiler tests install the
`gpu-plan` extra beside the test virtualenv (tests/gpu_compiler.py) and run `gpurl plan` in
a subprocess that sees it; the other checks need no compiler."""

from __future__ import annotations

import dataclasses

import pytest

import gpu_compiler
from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError
from gpurl.commands.plan import compiled_for
from gpurl.plan import targets
from gpurl.kernels import attention, platform
from gpurl.train import loop

# bf16 and head width 64: what cuDNN's flash attention and the Triton dots take
TINY = ["model=tiny", "model.dtype=bfloat16", "model.head_dim=64", "train.batch_size=4",
        "data.num_eval=0"]


def _table(stdout: str, program: str) -> str:
    """One program's table of `gpurl plan`'s output."""
    return stdout.split(f"{program} (GiB per device")[1].split(" (GiB per device")[0]


@pytest.fixture(scope="module")
def compiler():
    return gpu_compiler.install()


@pytest.mark.cuda_lowering
@pytest.mark.index
def test_grpo_compiles_for_four_h200s_with_cudnn_attention(compiler):
    out = gpu_compiler.gpurl(compiler, "plan", "algo=grpo", *TINY, "model.attention=auto",
                             "plan.target=h200", "plan.devices=4", "mesh.data=2", "mesh.tp=2")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert ("trainer mesh {'data': 2, 'fsdp': 1, 'context': 1, 'expert': 1, 'tp': 2} of 4 NVIDIA H200 "
            "(compile-only, plan.target=h200) device(s), model.dtype=bfloat16, "
            "model.remat=full") in text
    train, rollout = _table(text, "train step"), _table(text, "rollout")
    # auto on Hopper: cuDNN's flash attention (forward, backward; calls with a KV cache
    # fall back to the Pallas kernels); the rollout's prefill on cuDNN, its paged decode
    # on the Pallas kernel, once per layer (the rollout runs its 2 layers unrolled on GPU)
    assert "GPU kernels: cuDNN flash attention x" in train
    kernels = rollout.split("GPU kernels: ")[1].splitlines()[0]
    assert "cuDNN flash attention x2" in kernels and "Pallas (Triton) x2" in kernels
    # the compiler's account of each program, and the decode loop's weights in bf16
    assert "compiler's account, rollout decode chunk per decode step" in rollout
    assert "weights read in float32: none; weights converted inside the decode loop: none" in rollout
    # 143,771 MiB x JAX's default 0.75
    assert "device memory             105.301  -> fits" in train
    assert "(device memory: NVIDIA H200, 140.4 GiB x 0.75 (XLA_PYTHON_CLIENT_MEM_FRACTION))" in train
    assert "[gpurl] plan: fits" in text


@pytest.mark.cuda_lowering
@pytest.mark.index
def test_context_axis_compiles_for_h200s_with_the_pallas_kernel(compiler):
    """Rows split over a context axis of 2 (x data 2): the train step's attention runs the
    Pallas kernel under the gather (cuDNN's index-based mask cannot describe a split
    row), and the account counts its interconnect traffic. Prompts of 64 tokens prefill
    in chunks of 16 (`rollout.prefill_chunk`): each chunk attends to the prompts' key
    buffer by position, on the Pallas kernel too."""
    out = gpu_compiler.gpurl(compiler, "plan", "algo=grpo", *TINY, "model.attention=auto",
                             "plan.target=h200", "plan.devices=4", "mesh.data=2", "mesh.context=2",
                             "plan.prompt_len=64", "rollout.prefill_chunk=16")
    assert out.returncode == 0, out.stderr
    assert "'context': 2" in out.stdout
    train, rollout = _table(out.stdout, "train step"), _table(out.stdout, "rollout")
    assert "GPU kernels: Pallas (Triton) x" in train and "cuDNN" not in train
    assert "interconnect:" in train and "at NVLink's 450 GB/s" in train
    assert " prompts x 64 tokens" in rollout.split("rollout prefill per prefill")[1], rollout
    assert "GPU kernels: Pallas (Triton) x" in rollout and "cuDNN" not in rollout, rollout
    assert "[gpurl] plan: fits" in out.stdout


@pytest.mark.cuda_lowering
@pytest.mark.index
def test_pallas_compiles_for_an_a100_and_auto_picks_xla_on_a_v100(compiler):
    a100 = gpu_compiler.gpurl(compiler, "plan", "algo=sft", *TINY, "model.attention=pallas",
                              "model.lora.rank=4", "plan.target=a100")
    assert a100.returncode == 0, a100.stderr
    assert "GPU kernels: Pallas (Triton) x" in _table(a100.stdout, "train step")
    assert "cuDNN" not in a100.stdout
    # V100 (compute capability 7.0): no cuDNN flash attention, so auto runs xla; fp16
    v100 = gpu_compiler.gpurl(compiler, "plan", "algo=sft", *TINY, "model.attention=auto",
                              "model.dtype=float16", "plan.target=v100")
    assert v100.returncode == 0, v100.stderr
    assert "GPU kernels: XLA's own fusions only" in _table(v100.stdout, "train step")
    assert "model.dtype=float16" in v100.stdout and "of 11.8 GiB per device" in v100.stdout


def test_target_errors_are_one_sentence(tmp_path, monkeypatch):
    cfg = make_config(algo={"name": "sft"}, model=TINY_MODEL, run={"dir": str(tmp_path)})
    plan = lambda **kw: dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, **kw))  # noqa: E731
    with pytest.raises(ConfigError, match=r"^plan.target=b200 is not a GPU gpurl can compile "
                                          r"for; use one of h100, h200, a100, v100\.$"):
        with compiled_for(plan(target="b200")):
            pass
    monkeypatch.setattr(targets, "PLUGINS", ("jax_plugins.not_installed",))
    with pytest.raises(ConfigError) as info:
        with compiled_for(plan(target="h100")):
            pass
    assert 'pip install -e ".[gpu-plan]"' in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not whole 8-GPU hosts"):
        targets.topology(12)
    with pytest.raises(ConfigError, match="is for `gpurl plan`; drop it from gpurl train"):
        loop.train(plan(target="h100"))
    assert not (tmp_path / "config.yaml").exists()


def test_target_descriptions_and_topologies():
    h100 = targets.GPUS["h100"].target_config()
    assert "core_count: 132" in h100 and "cuda_compute_capability { major: 9 minor: 0 }" in h100
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in h100
    assert targets.GPUS["h200"].memory_bytes == 150_754_820_096
    assert [targets.topology(n) for n in (1, 4, 8, 16)] == ["1x1x1", "1x1x4", "1x1x8", "1x2x8"]


@pytest.mark.parametrize("capability, chosen", [((9, 0), "cudnn"), ((8, 0), "cudnn"),
                                                 ((7, 5), "xla"), ((7, 0), "xla")])
def test_auto_attention_follows_the_targeted_gpus_capability(capability, chosen):
    with platform.target("gpu", capability):
        assert attention.resolve("auto") == chosen
    assert attention.resolve("auto") == "xla"  # this CPU, after the block
