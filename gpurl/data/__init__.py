"""gpurl.data: rows (generated tasks, GSM8K, jsonl) for SFT and RL, SFT token rows, batching."""

from gpurl.data.batching import eval_batches, process_rows, step_indices, take
from gpurl.data.sft import TokenRows, encode_sft
from gpurl.data.sources import (TASK_REWARDS, default_rewards, load_examples, load_prompts,
                                read_jsonl)
from gpurl.data.tasks import TASKS, arithmetic, countdown

__all__ = [
    "TASKS", "TASK_REWARDS", "TokenRows", "arithmetic", "countdown", "default_rewards",
    "encode_sft", "eval_batches", "load_examples", "load_prompts", "process_rows", "read_jsonl",
    "step_indices", "take",
]
