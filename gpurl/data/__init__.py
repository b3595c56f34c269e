"""gpurl.data: examples (generated tasks, jsonl), SFT token rows, and step batching."""

from gpurl.data.batching import eval_batches, process_rows, step_indices, take
from gpurl.data.sft import TokenRows, encode_sft
from gpurl.data.sources import load_examples, read_jsonl
from gpurl.data.tasks import TASKS, arithmetic

__all__ = [
    "TASKS", "TokenRows", "arithmetic", "encode_sft", "eval_batches", "load_examples",
    "process_rows", "read_jsonl", "step_indices", "take",
]
