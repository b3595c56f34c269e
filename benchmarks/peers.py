"""gpurl against the libraries users would pick instead, on one machine, in one run.

On the real Gemma 3 270M (the GGUF from the PyPI package, dequantized to float32), CPU,
identical settings on both sides:

- GRPO: `gpurl train` (algo=grpo, the main job's settings: 4 prompts x G=8, <= 8 new
  tokens stopped at the first newline, lr 1e-6 constant, beta 0.04 (k3 KL to the initial
  model), clip 0.2, per-sequence token means, tied embedding frozen, grad-norm clip 1)
  against TRL's `GRPOTrainer` with the same settings (`loss_type="grpo"`, group-std
  scaled advantages, a newline as a stop token, `first_number_match` as the reward), fed
  the same prompts in the same order (the few-shot addition task, gpurl/data/tasks.py).
- SFT: `gpurl train algo=sft optim=adamw train=default` (16 examples of the same task per
  step, rows of 64 tokens, AdamW lr 1e-3 with 10 warm-up steps, every parameter trained,
  loss on completion tokens) against TRL's `SFTTrainer` with the same examples in the same
  order and the same optimizer settings.
- Generation: `benchmarks/generate.py` (gpurl's StaticSampler against transformers' `generate`,
  interleaved in one process).

Every training job runs in its own subprocess, one after the other (never two at once),
so its peak resident memory (`ru_maxrss` from `wait4`, the whole process: loading,
compiling, every step) is its own. Step times are medians of the steps after the first
`--warmup` (the first step includes gpurl's XLA compilation and TRL's lazy set-up; both
are excluded). Neither side evaluates or checkpoints during the timed steps; gpurl writes
its one final checkpoint after the last step (outside the step times). Gradient
checkpointing is off on both sides (gpurl does not rematerialize); TRL runs in float32
(`bf16=False`), as gpurl does on CPU.

    python benchmarks/peers.py --steps 4 --json peers.json  # ~50 min on 2 loaded cores
    python benchmarks/peers.py --quick --json peers.json    # smoke run: 3 steps, small generation
    python benchmarks/peers.py --smoke   # gpurl's side on the tiny random model (TRL's skipped)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
PARTS = ("grpo", "sft", "generate")
# The main job (configs/config.yaml: algo=grpo, data=addition, optim=rl, train=rl,
# rollout=short); the TRL side copies these values.
GRPO = dict(prompts=4, group=8, new_tokens=8, lr=1e-6, beta=0.04, epsilon=0.2, seed=0)
# `gpurl train algo=sft optim=adamw train=default` (configs/optim/adamw.yaml, train/default.yaml).
SFT = dict(batch=16, max_len=64, lr=1e-3, warmup=10, seed=0)
# Evaluation and per-step checkpoints off: only training steps are timed.
GPURL_COMMON = ["data.num_eval=0", "train.eval_every=0", "train.checkpoint_every=0",
                "logger=console"]
# --smoke: gpurl's jobs on the tiny random model and its task (TRL's side needs the real one)
SMOKE_GPURL = ["model=tiny", "data=arithmetic", "rollout.max_new_tokens=8"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--steps", type=int, default=6, help="training steps per job (warm-up included)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--gen-batch", type=int, default=32, help="generation: rows per call")
    p.add_argument("--gen-new-tokens", type=int, default=64, help="generation: tokens per row")
    p.add_argument("--gen-repeats", type=int, default=3, help="generation: timed calls per cell")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3 steps (median of 2), generation at batch 8, 16 tokens, 1 call")
    p.add_argument("--smoke", action="store_true", help="gpurl's side on the tiny random model, "
                   "2 steps, TRL's side skipped, generate.py --smoke: the script runs")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads of the TRL / transformers side")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_peers.json"))
    p.add_argument("--worker", choices=("trl_grpo", "trl_sft"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)  # worker: where to write its timings
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.gen_batch, args.gen_new_tokens, args.gen_repeats = 3, 8, 16, 1
    if args.smoke:
        args.steps = 2
    args.parts = args.parts.split(",")
    if set(args.parts) - set(PARTS):
        p.error(f"--parts takes a subset of {','.join(PARTS)}.")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup: at least one timed step is needed.")
    return args


# ------------------------------------------------------------------- the same data


def grpo_prompts(steps: int) -> list[dict]:
    """The prompts `gpurl train` uses in steps 0..steps-1, in order, G-fold repetition left
    to the trainer: the main job's data config (configs/data/addition.yaml)."""
    from gpurl.data.batching import step_indices
    from gpurl.data.sources import load_prompts

    train, _ = load_prompts(_data(False, num_eval=0))
    return [train[i] for s in range(steps)
            for i in step_indices(len(train), GRPO["prompts"], s, GRPO["seed"])]


def sft_examples(steps: int, smoke: bool = False) -> list[dict]:
    """The examples `gpurl train algo=sft ...` uses in steps 0..steps-1, in order."""
    from gpurl.data.batching import step_indices
    from gpurl.data.sources import load_examples

    train, _ = load_examples(_data(smoke, num_eval=0))
    return [train[i] for s in range(steps)
            for i in step_indices(len(train), SFT["batch"], s, SFT["seed"])]


def sft_tokens_per_step(steps: int, smoke: bool = False) -> list[int]:
    """Real (non-padding) tokens of each gpurl SFT step: bos + prompt + completion + eos
    (`smoke`: the tiny model's bytes of its task)."""
    from gpurl.data.sft import encode_sft
    from gpurl.models.gguf import default_gemma3_270m_path
    from gpurl.models.gguf_tokenizer import tokenizer_from_gguf
    from gpurl.models.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer() if smoke else tokenizer_from_gguf(default_gemma3_270m_path())
    rows = encode_sft(sft_examples(steps, smoke), tokenizer, _data(smoke, num_eval=0))
    per_N = (rows.segment_ids > 0).sum(-1)
    return [int(per_N[s * SFT["batch"]:(s + 1) * SFT["batch"]].sum()) for s in range(steps)]


def _data(smoke: bool, **overrides: Any):
    """The main job's data config (configs/data/addition.yaml) as a DataConfig, or with
    `smoke` the tiny model's (configs/data/arithmetic.yaml)."""
    import yaml

    from gpurl.config import DataConfig

    name = "arithmetic" if smoke else "addition"
    values = yaml.safe_load((HERE.parent / f"configs/data/{name}.yaml").read_text())
    return DataConfig(**{**values, **overrides})


# ------------------------------------------------------------------------ TRL side


def _trl_load(threads: int) -> tuple[Any, Any, Path]:
    """transformers' own GGUF loader (fp32), as benchmarks/generate.py uses it."""
    import torch
    import transformers

    from gpurl.models.gguf import default_gemma3_270m_path

    torch.set_num_threads(threads)
    file = Path(default_gemma3_270m_path())
    tok = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32)
    # The weights are dequantized to fp32 on load, yet transformers keeps the GGUF's
    # quantizer on the model, and Trainer refuses to train a "quantized" model; transformers'
    # (its dequantize path): drop that mark.
    model.hf_quantizer.remove_quantization_config(model)
    model.config._is_quantized = False
    return tok, model, file


def _step_timer() -> Any:
    """A transformers TrainerCallback recording the wall time of each optimizer step (for
    GRPO: generation + rewards + log-probs + update, as TRL runs them inside the step)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times_s: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times_s.append(time.perf_counter() - self._t0)

    return StepTimer()


def trl_grpo(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl

    from generate import shared_gguf_parse
    from gpurl.rewards.builtin import first_number_match as gpurl_reward

    def first_number_match(prompts, completions, answer, **_):
        """gpurl's built-in reward: 1.0 when the first number of the completion is `answer`."""
        return gpurl_reward(prompts, completions, answer)

    rows = grpo_prompts(args.steps)
    data = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                                       for r in rows])
    timer = _step_timer()
    with tempfile.TemporaryDirectory() as out, shared_gguf_parse():
        tok, model, _ = _trl_load(args.threads)
        # TRL builds its reference model with from_pretrained(<the policy's path>), which
        # cannot read a GGUF; so both come from an HF directory of the dequantized weights.
        model.save_pretrained(f"{out}/model")
        del model
        model = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/model",
                                                                  dtype=torch.float32)
        # gpurl's optim=rl freezes the tied 262k x 640 embedding (and so the head).
        model.get_input_embeddings().weight.requires_grad_(False)
        # rollout.stop=["\n"]: the newline ends a completion as EOS does (TRL stops and
        # masks at every id of the model's generation_config.eos_token_id).
        newline = tok.encode("\n", add_special_tokens=False)
        model.generation_config.eos_token_id = [tok.eos_token_id, *newline]
        g = GRPO["group"]
        config = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=GRPO["prompts"] * g,
            num_generations=g, steps_per_generation=1, gradient_accumulation_steps=1,
            max_completion_length=GRPO["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=GRPO["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, beta=GRPO["beta"], epsilon=GRPO["epsilon"],
            loss_type="grpo", scale_rewards="group", num_iterations=1, shuffle_dataset=False,
            max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[],
            bf16=False, use_cpu=True, gradient_checkpointing=False, seed=GRPO["seed"],
            disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[first_number_match], args=config,
                                  train_dataset=data, processing_class=tok, callbacks=[timer])
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_s": timer.times_s, "trainable_params": trainable, "reward_mean": rewards}


def trl_sft(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import trl

    from generate import shared_gguf_parse

    tokens: list[int] = []

    class InOrder(trl.SFTTrainer):
        """gpurl's examples in gpurl's order (no shuffle), counting each batch's tokens."""

        def _get_train_sampler(self, *_: Any, **__: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, model, inputs, *rest):
            mask = inputs.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
            return super().training_step(model, inputs, *rest)

    rows = sft_examples(args.steps)
    data = datasets.Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                       for r in rows])
    timer = _step_timer()
    with tempfile.TemporaryDirectory() as out, shared_gguf_parse():
        tok, model, _ = _trl_load(args.threads)
        config = trl.SFTConfig(
            output_dir=out, per_device_train_batch_size=SFT["batch"], max_length=SFT["max_len"],
            packing=False, completion_only_loss=True, learning_rate=SFT["lr"],
            warmup_steps=SFT["warmup"], lr_scheduler_type="cosine", weight_decay=0.0,
            max_grad_norm=1.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
            report_to=[], bf16=False, use_cpu=True, gradient_checkpointing=False,
            seed=SFT["seed"], disable_tqdm=True)
        trainer = InOrder(model=model, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[timer])
        trainer.train()
    return {"step_s": timer.times_s, "tokens": tokens}


def run_worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    result = {"trl_grpo": trl_grpo, "trl_sft": trl_sft}[args.worker](args)
    Path(args.out).write_text(json.dumps(result))


# ------------------------------------------------------------------------ driver


def gpurl_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from gpurl.cli import main; sys.exit(main())",
            "train", *overrides]


def run_job(name: str, command: list[str], log: Path) -> dict[str, Any]:
    """Runs one job to completion: wall time, peak RSS (wait4), load averages, exit status."""
    load_before = os.getloadavg()
    start = time.perf_counter()
    print(f"[peers] {name}: {' '.join(command[:2])} ... (log {log})", flush=True)
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); end of {log}:\n{tail}")
    print(f"[peers] {name}: {wall:.0f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GB", flush=True)
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def gpurl_metrics(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])


def bench_grpo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / "gpurl-grpo"
    smoke = SMOKE_GPURL if args.smoke else []
    out: dict[str, Any] = {"gpurl": run_job("gpurl grpo", gpurl_command(
        ["algo=grpo", f"train.steps={args.steps}", f"run.dir={run_dir}", *GPURL_COMMON, *smoke]),
        work / "gpurl-grpo.log")}
    steps = gpurl_metrics(run_dir)[args.warmup:]
    out["gpurl"].update({"step_s": [r["time/step_s"] for r in steps],
                         "median_step_s": _median([r["time/step_s"] for r in steps])})
    for phase in ("rollout", "reward", "train", "sync"):
        out["gpurl"][f"median_{phase}_s"] = _median([r[f"time/{phase}_s"] for r in steps])
    shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: ~2 GB
    out["gpurl"]["completions_per_s"] = round(GRPO["prompts"] * GRPO["group"]
                                              / out["gpurl"]["median_step_s"], 3)
    if args.smoke:
        print("trl grpo: skipped: the smoke form runs gpurl's side only (TRL's needs the real model)")
        return out
    trl_out = work / "trl-grpo.json"
    out["trl"] = run_job("trl grpo", [sys.executable, __file__, "--worker", "trl_grpo",
                                      "--steps", str(args.steps), "--threads", str(args.threads),
                                      "--out", str(trl_out)], work / "trl-grpo.log")
    trl = json.loads(trl_out.read_text())
    out["trl"].update(trl, step_s=trl["step_s"][args.warmup:],
                      median_step_s=_median(trl["step_s"][args.warmup:]))
    out["trl"]["completions_per_s"] = round(GRPO["prompts"] * GRPO["group"]
                                            / out["trl"]["median_step_s"], 3)
    out["speedup"] = round(out["trl"]["median_step_s"] / out["gpurl"]["median_step_s"], 2)
    out["memory_ratio"] = round(out["gpurl"]["peak_rss_gb"] / out["trl"]["peak_rss_gb"], 2)
    return out


def bench_sft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    # TRL first here, so that neither framework always runs first (the machine is shared).
    trl_out, out, sides = work / "trl-sft.json", {}, {}
    if args.smoke:
        print("trl sft: skipped: the smoke form runs gpurl's side only (TRL's needs the real model)")
    else:
        out["trl"] = run_job("trl sft", [
            sys.executable, __file__, "--worker", "trl_sft", "--steps", str(args.steps),
            "--threads", str(args.threads), "--out", str(trl_out)], work / "trl-sft.log")
        trl = json.loads(trl_out.read_text())
        sides["trl"] = (trl["step_s"], trl["tokens"])
    run_dir = work / "gpurl-sft"
    out["gpurl"] = run_job("gpurl sft", gpurl_command(
        ["algo=sft", "optim=adamw", "train=default", f"train.steps={args.steps}",
         f"run.dir={run_dir}", *GPURL_COMMON, *(SMOKE_GPURL[:2] if args.smoke else [])]),
        work / "gpurl-sft.log")
    gpurl_s = [r["time/step_s"] for r in gpurl_metrics(run_dir)]
    shutil.rmtree(run_dir, ignore_errors=True)
    sides["gpurl"] = (gpurl_s, sft_tokens_per_step(args.steps, args.smoke))
    for side, (times, tokens) in sides.items():
        times, tokens = times[args.warmup:], tokens[args.warmup:]
        out[side].update(step_s=times, tokens=tokens, median_step_s=_median(times),
                         tokens_per_s=round(statistics.median(
                             n / t for n, t in zip(tokens, times)), 1))
    if "trl" not in out:
        return out
    out["speedup"] = round(out["gpurl"]["tokens_per_s"] / out["trl"]["tokens_per_s"], 2)
    out["memory_ratio"] = round(out["gpurl"]["peak_rss_gb"] / out["trl"]["peak_rss_gb"], 2)
    return out


def bench_generate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    path = work / "generate.json"
    job = run_job("generate (gpurl and transformers, interleaved)", [
        sys.executable, str(HERE / "generate.py"), "--batches", str(args.gen_batch),
        "--new-tokens", str(args.gen_new_tokens), "--repeats", str(args.gen_repeats),
        "--threads", str(args.threads), "--json", str(path),
        *(["--smoke"] if args.smoke else [])], work / "generate.log")
    return {"job": job, "table": json.loads(path.read_text())["table"]}


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measurement: gpurl, TRL / transformers, gpurl's advantage (> 1 = better;
    "-" where the peer did not run: the smoke form)."""
    def row(what: str, part: dict[str, Any], key: str, advantage: Any) -> dict[str, Any]:
        peer = part.get("trl", {}).get(key, "-")
        return {"what": what, "gpurl": part["gpurl"][key], "peer": peer,
                "gpurl_advantage": advantage() if "trl" in part else "-"}

    rows = []
    if "grpo" in res:
        g = res["grpo"]
        rows += [row("GRPO s/step (median)", g, "median_step_s", lambda: g["speedup"]),
                 row("GRPO peak RSS GB", g, "peak_rss_gb", lambda: round(1 / g["memory_ratio"], 2))]
    if "sft" in res:
        s = res["sft"]
        rows += [row("SFT tokens/s (median)", s, "tokens_per_s", lambda: s["speedup"]),
                 row("SFT s/step (median)", s, "median_step_s", lambda: round(
                     s["trl"]["median_step_s"] / s["gpurl"]["median_step_s"], 2)),
                 row("SFT peak RSS GB", s, "peak_rss_gb", lambda: round(1 / s["memory_ratio"], 2))]
    for r in res.get("generate", {}).get("table", []):
        rows.append({"what": f"generate tok/s, B={r['batch']} {r['mode']}",
                     "gpurl": r.get("gpurl_tok_s"), "peer": r.get("transformers_tok_s"),
                     "gpurl_advantage": r.get("ratio")})
    return rows


def print_table(rows: list[dict[str, Any]], res: dict[str, Any]) -> None:
    print("| measurement | gpurl | TRL / transformers | gpurl advantage |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        advantage = r["gpurl_advantage"]
        print(f"| {r['what']} | {r['gpurl']} | {r['peer']} | "
              f"{advantage if advantage == '-' else f'{advantage}x'} |")
    if "grpo" in res:
        g = res["grpo"]["gpurl"]
        print(f"gpurl GRPO phases (median s): rollout {g['median_rollout_s']}, reward "
              f"{g['median_reward_s']}, train {g['median_train_s']}, sync {g['median_sync_s']}")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    versions = {name: installed(name) for name in
                ("jax", "torch", "transformers", "trl", "accelerate", "datasets")}
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "torch_threads": args.threads,
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "load_average_start": os.getloadavg(), "python": platform.python_version(),
            **versions}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    env = environment(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker", "out")}
    results: dict[str, Any] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpurl_peers_") as tmp:
        work = Path(tmp)
        for part in args.parts:
            try:
                results[part] = {"grpo": bench_grpo, "sft": bench_sft,
                                 "generate": bench_generate}[part](args, work)
            except RuntimeError as e:
                for log in work.glob("*.log"):  # keep the logs of a failed job
                    shutil.copy(log, Path(args.json).with_suffix(f".{log.stem}.log"))
                raise SystemExit(f"[peers] {e}")
    env["load_average_end"] = os.getloadavg()
    env["total_s"] = round(time.perf_counter() - start, 1)
    rows = summary_rows(results)
    print_table(rows, results)
    print(f"load average (1, 5, 15 min) at start {env['load_average_start']}, at end "
          f"{env['load_average_end']}; {env['cores']} cores; {env['total_s']} s in all")
    Path(args.json).write_text(json.dumps({"settings": settings, "grpo": GRPO, "sft": SFT,
                                           "environment": env, "table": rows,
                                           "results": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
