"""Request and response schemas of the OpenAI-compatible API, with the OpenAI API's field
names (https://platform.openai.com/docs/api-reference/chat). Fields a client may send that
gpurl does not use (`user`, `metadata`, `parallel_tool_calls`, ...) are accepted and
ignored; vLLM's extensions `top_k` and `return_token_ids` are served."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16  # `n` at most (a call's choices are one group of the engine)
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    return_token_ids: bool = False

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = Field(None, ge=1)  # null: the server's rollout.max_new_tokens (OpenAI's API: 16)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def limit(self) -> Optional[int]:
        return self.max_tokens


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    message: dict[str, Any]
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: Optional[ChoiceLogprobs] = None
    token_ids: Optional[list[int]] = None  # return_token_ids (vLLM)
    stop_reason: Optional[Union[str, int]] = None  # the stop string or token id that ended it (vLLM)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids (vLLM)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: Optional[CompletionLogprobs] = None
    token_ids: Optional[list[int]] = None
    stop_reason: Optional[Union[str, int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpurl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
