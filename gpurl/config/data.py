"""The schema of the `data` config group (generated tasks, files in gpurl's, TRL's and
verl's layouts, Hub datasets), re-exported by `gpurl.config`. A leaf
module: it imports only `gpurl.config.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpurl.config.checks import ConfigError
from gpurl.config.checks import choice as _choice, positive as _positive, tuplify as _tuplify


@dataclass(frozen=True)
class DataConfig:
    name: str = "arithmetic"  # source: arithmetic, arithmetic_prefs, countdown, calculator, guess_number or quadrant (generated; quadrant has images, for a vision-language model), jsonl (+ data.path), gsm8k or math (+ data.path, else their preset's data.dataset), hf (+ data.dataset)
    # data=jsonl: a jsonl, json, parquet, csv or arrow file or a save_to_disk directory, in
    # gpurl's, TRL's or verl's layout (docs/data.md); gsm8k rows {"question","answer"}; math
    # rows {"problem","solution"[,"answer"]}; dpo, simpo and orpo rows {"prompt","chosen","rejected"}
    path: Optional[str] = None
    eval_path: Optional[str] = None  # held-out rows (same formats); null = hold out data.num_eval rows of path
    dataset: Optional[str] = None  # data=hf (and data=gsm8k / math without data.path): a Hub id, e.g. openai/gsm8k or openai/gsm8k@main (fetched into the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache only), or a local dataset directory
    subset: Optional[str] = None  # data.dataset's config name, e.g. main; null = its default
    split: str = "train"  # data.dataset's, and save_to_disk directories' (holding several splits), training split
    eval_split: Optional[str] = None  # data.dataset's held-out split, e.g. test; null = hold out data.num_eval rows
    prompt_key: str = "prompt"  # column holding the prompt (text or a chat list)
    completion_key: str = "completion"  # column holding the SFT reference completion
    messages_key: str = "messages"  # column holding a whole conversation (SFT: ends with the reply)
    answer_key: Optional[str] = None  # column of the ground truth (rewards' `answer`; dots reach nested columns); null = answer, else verl's reward_model.ground_truth
    chosen_key: str = "chosen"  # preference pairs: column of the preferred completion
    rejected_key: str = "rejected"  # preference pairs: column of the other completion
    max_len: int = 64  # tokens per row: longer RL prompts and preference pairs are skipped, longer SFT examples truncated (each counted in the start-up line)
    packing: bool = False  # pack several examples into one row (attention stays per example)
    chat_template: bool = False  # render prompt/completion through the tokenizer's chat template
    num_train: int = 2000  # generated tasks: training examples
    num_eval: int = 200  # held-out examples (generated tasks, and files without eval_path)
    seed: int = 1234  # seed of the generated task items, the hold-out split and the few-shot set
    few_shot: int = 0  # worked examples prepended to every prompt (drawn per prompt from training rows)
    a_range: list[int] = field(default_factory=lambda: [0, 99])  # arithmetic: first operand in [lo, hi], inclusive
    b_range: list[int] = field(default_factory=lambda: [0, 99])  # arithmetic: second operand in [lo, hi], inclusive
    ops: list[str] = field(default_factory=lambda: ["+", "-"])  # arithmetic: any of +, -, * (a - b only when a >= b)
    countdown_numbers: int = 3  # countdown: numbers given per problem (2 to 6)
    countdown_max: int = 20  # countdown: numbers are drawn from 1..countdown_max
    prompt_template: Optional[str] = None  # gsm8k and math: prompt with {question} (the question / problem); null = the source's own
    append_eos: bool = True  # preference pairs: end chosen and rejected with the EOS token (as SFT completions)

    def __post_init__(self) -> None:
        _tuplify(self)
        _choice("data.name", self.name, ("arithmetic", "countdown", "gsm8k", "math", "jsonl",
                                         "hf", "arithmetic_prefs", "calculator", "guess_number",
                                         "quadrant"))
        if self.name == "jsonl" and not self.path:
            raise ConfigError("data=jsonl needs a file; set data.path=/path/to/train.jsonl.")
        if self.name in ("gsm8k", "math") and not self.path and not self.dataset:
            raise ConfigError(f"data={self.name} needs rows; set data.dataset to a Hub id or "
                              f"data.path to a file.")
        if self.name == "hf" and not self.dataset:
            raise ConfigError("data=hf needs a dataset; set data.dataset=owner/name (a Hub id) "
                              "or a local dataset directory.")
        _positive("data.max_len", self.max_len)
        _positive("data.num_train", self.num_train)
        _positive("data.num_eval", self.num_eval, allow_zero=True)
        _positive("data.few_shot", self.few_shot, allow_zero=True)
        if self.few_shot and self.name in ("jsonl", "hf"):
            raise ConfigError("data.few_shot needs reference completions, which jsonl rows "
                              "may lack; write the worked examples into the prompts and set "
                              "data.few_shot=0.")
        for key in ("a_range", "b_range"):
            lo_hi = getattr(self, key)
            if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
                raise ConfigError(f"data.{key}={list(lo_hi)} is not valid; give [lo, hi] "
                                  f"with 0 <= lo <= hi.")
        if not self.ops or not set(self.ops) <= {"+", "-", "*"}:
            raise ConfigError(f"data.ops={list(self.ops)} is not valid; give a non-empty list "
                              f"of +, - and *.")
        if not 2 <= self.countdown_numbers <= 6:
            raise ConfigError(f"data.countdown_numbers={self.countdown_numbers} is not valid; "
                              f"use 2 to 6 numbers.")
        _positive("data.countdown_max", self.countdown_max)
        if self.prompt_template is not None and (
                self.name not in ("gsm8k", "math") or "{question}" not in self.prompt_template):
            raise ConfigError(f"data.prompt_template={self.prompt_template!r} is not valid; it "
                              f"applies to data=gsm8k and data=math and must contain {{question}}.")
