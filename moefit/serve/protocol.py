"""OpenAI request schemas, validated into the engine's terms. A bad field is an ApiError
(400) that names it; an unknown model is a 404."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moefit.runtime.sampler import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False          # vLLM's extension: keep going past the end-of-text token

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool = False


def parse(model_type, raw: bytes):
    """Body bytes -> a validated request, or ApiError(400) naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = model_type.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{field}: {err['msg']}", param=field) from None
    if req.n != 1:
        raise ApiError(400, "n: only n=1 is supported (one engine, one sequence)", param="n")
    return req


def sampling(req: _Sampling, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          seed=req.seed, stop=req.stops(), ignore_eos=req.ignore_eos)


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content, tool-call arguments as objects."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(p.get("text", "") for p in m.content if p.get("type", "text") == "text")
        d.setdefault("content", "")
        if m.tool_calls:
            d["tool_calls"] = [_tool_call(tc) for tc in m.tool_calls]
        out.append(d)
    return out


def _tool_call(tc: dict) -> dict:
    fn = dict(tc.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(400, "messages: a tool call's arguments are not valid JSON",
                           param="messages.tool_calls.function.arguments") from None
    return {**tc, "function": fn}
