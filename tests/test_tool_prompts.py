"""Tool schemas reach the model: a tools environment's chat prompts render its tools
through the template's `tools=` argument, text for text as transformers'
`apply_chat_template(..., tools=...)` renders them (transformers is the reference)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from gpurl.config import DataConfig, EnvConfig, ModelConfig, TrainConfig
from gpurl.data.sources import load_prompts
from gpurl.envs import load_tools
from gpurl.envs.formats import ToolCallError
from gpurl.models.loading import load_tokenizer
from gpurl.models.tokenizer import byte_tokenizer
from gpurl.rollout.prompts import encode_prompts, prompt_tools
from gpurl.train.rl import _prompts

# A Qwen 2.5-style (hermes) template: the tools as JSON lines in the system turn.
TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>"
    " XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a function as <tool_call>{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The schemas as a user writes them for transformers (OpenAI function format).
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. 37 * (12 + 5)"}}}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Looks a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"},
                                                    "limit": {"type": "integer"}},
                   "required": ["word"]}}}


def lookup(word: str, limit: int = 3) -> str:
    """Looks a word up in the dictionary.

    Returns at most `limit` senses."""
    return f"{word}: {limit} senses"


def wrapped(x: int) -> int:
    return x


wrapped.schema = {"type": "function", "function": {  # type: ignore[attr-defined]
    "name": "wrapped", "description": "Returns x.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                   "required": ["x"]}}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(gpurl's tokenizer, transformers' tokenizer) of one folder: byte vocabulary, the
    template above."""
    folder: Path = tmp_path_factory.mktemp("hermes")
    byte_tokenizer().tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
         "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}))
    return (load_tokenizer(ModelConfig(tokenizer=str(folder))),
            transformers.AutoTokenizer.from_pretrained(str(folder)))


def _hf_prompt(hf, prompt: str, tools: list[dict] | None) -> str:
    return hf.apply_chat_template([{"role": "user", "content": prompt}], tools=tools,
                                  add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("env, reference", [
    (EnvConfig(name="tools", tools=["calculator", "test_tool_prompts:lookup"]),
     [CALCULATOR, LOOKUP]),
    (EnvConfig(name="calculator"), [CALCULATOR]),  # its default tool
])
def test_chat_prompts_of_a_tools_environment_carry_its_schemas(tokenizers, env, reference):
    """Encoded as the trainer, `gpurl eval` and `gpurl generate` encode them: the prompt
    text is transformers' rendering with `tools=` the hand-written schemas."""
    tok, hf = tokenizers
    data = DataConfig(name="calculator", num_train=4, num_eval=2, max_len=4096,
                      chat_template=True)
    rows = load_prompts(data)[1]
    prompts, _ = encode_prompts(rows, tok, True, data.max_len, "eval", prompt_tools(env))
    for row, ids in zip(prompts.rows, prompts.tokens):
        assert ids[0] == tok.bos_id
        assert tok.decode(ids) == _hf_prompt(hf, row["prompt"], reference)
    assert "<tools>\n" + "\n".join(json.dumps(t) for t in reference) + "\n</tools>" in (
        tok.decode(prompts.tokens[0]))
    # The trainer's prompts (read by its rollouts, continuous ones too) are these.
    train, evals, _ = _prompts(data, SimpleNamespace(tokenizer=tok), env, TrainConfig())
    assert evals.tokens == prompts.tokens and len(train) == 4


def test_prompts_without_tools_or_template_are_unchanged(tokenizers):
    """An environment without tools renders as transformers does with no `tools`; a plain
    prompt (no chat template) is its text, no schema added."""
    tok, hf = tokenizers
    assert prompt_tools(EnvConfig(name="guess_number")) == prompt_tools(None) == []
    rows = [{"prompt": "Guess:"}]
    chat, _ = encode_prompts(rows, tok, True, 512, "eval", [])
    assert tok.decode(chat.tokens[0]) == _hf_prompt(hf, "Guess:", None)
    assert "<tools>" not in _hf_prompt(hf, "Guess:", None)
    plain, _ = encode_prompts(rows, tok, False, 512, "eval", [CALCULATOR])
    assert tok.decode(plain.tokens[0]) == "Guess:"


def test_a_schema_in_the_function_format_loads_and_checks_calls():
    """`fn.schema` may be written as transformers takes it ({"type": "function", ...})."""
    (tool,) = load_tools(["test_tool_prompts:wrapped"])
    assert tool.schema == wrapped.schema["function"] and tool.function == wrapped.schema
    tool.check({"x": 1})
    with pytest.raises(ToolCallError, match=r"unknown arguments \['y'\]"):
        tool.check({"y": 1})
