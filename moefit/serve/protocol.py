"""OpenAI request schemas, validated into the engine's terms. A bad field is an ApiError
(400) that names it; an unknown model is a 404."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moefit.runtime.sampler import SamplingParams, choice_seed

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_DEPTH = 64                 # JSON nesting a request may have: OpenAI bodies need about 8
SEED_RANGE = (-(2**63), 2**64 - 1)   # what a 64-bit generator seed can hold (OpenAI's is int64)
TEMPLATE_SET = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")   # render_chat's own
MAX_CHOICES = 16               # n: the choices run one after another, each a whole generation


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
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False          # vLLM's extension: keep going past the end-of-text token
    logit_bias: dict[str, float] | None = None

    def bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; a key that is no token id of this model, or a bias
        outside [-100, 100], is a 400 naming it."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.strip().isdigit() and int(key) < vocab):
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})",
                               param="logit_bias")
            if not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias: the bias of token {key} is {bias}, outside [-100, 100]",
                               param="logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    refused: ClassVar[dict[str, str]] = {}                  # fields that would change the answer: a 400, not ignored

    def refusal(self, data: dict) -> str | None:
        """The first refused field the body sets to something this request cannot honour, or None."""
        return next((f for f in self.refused if data.get(f) not in (None, "", [], {}) and not self.honours(f, data[f])),
                    None)

    def honours(self, field: str, value) -> bool:
        """Whether a refused field's value is one this request can serve after all."""
        return False

    def choices(self) -> list:
        """This request once for each of its n choices: n=1, and choice i's seed (choice_seed)."""
        return [self.model_copy(update={"n": 1, "seed": choice_seed(self.seed, i)}) for i in range(self.n)]


class ChatRequest(_Sampling):
    refused: ClassVar[dict[str, str]] = {
        "functions": "the deprecated functions API is not supported; send them as tools",
        "function_call": "the deprecated functions API is not supported; send tool_choice"}
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None      # vLLM's: {"enable_thinking": false} for Qwen3
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None   # gpt-oss's template reads it

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables beyond the messages and tools (those the server sets are a 400)."""
        given = self.chat_template_kwargs or {}
        for key in given:
            if key in TEMPLATE_SET:
                raise ApiError(400, f"chat_template_kwargs: {key!r} is set by the server", param="chat_template_kwargs")
        return {**({"reasoning_effort": self.reasoning_effort} if self.reasoning_effort else {}), **given}


class CompletionRequest(_Sampling):
    refused: ClassVar[dict[str, str]] = {
        "suffix": "fill-in-the-middle (a suffix after the completion) is not supported",
        "best_of": "ranking candidates is not supported; n gives that many choices"}

    def honours(self, field: str, value) -> bool:
        return field == "best_of" and value in (1, self.n)                 # every candidate returned: n choices
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        """Each prompt of the request: a string or a list of token ids (one choice each)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def one(self, prompt) -> "CompletionRequest":
        return self.model_copy(update={"prompt": prompt})


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def load_json(raw: bytes):
    """Body bytes -> JSON data, or ApiError(400): invalid JSON, NaN / Infinity (not JSON),
    nesting deeper than MAX_DEPTH, lone UTF-16 surrogates (no text can hold them)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    _check_tree(data)
    return data


def _check_tree(data, path: str = "", depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels", param=path or None)
    if isinstance(data, dict):
        for k, v in data.items():
            _check_text(k, path)
            _check_tree(v, f"{path}.{k}" if path else k, depth + 1)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_tree(v, f"{path}.{i}", depth + 1)
    elif isinstance(data, str):
        _check_text(data, path)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{path or 'the body'}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                       "without its pair), which is not a character", param=path or None) from None


def parse(model_type, raw: bytes):
    """Body bytes -> a validated request, or ApiError(400) naming the field."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = model_type.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{field}: {err['msg']}", param=field) from None
    if isinstance(req, _Sampling) and (field := req.refusal(data)):
        raise ApiError(400, f"{field}: {req.refused[field]}", param=field)
    if isinstance(req, ChatRequest):
        for i, m in enumerate(req.messages):
            _check_parts(i, m)
    return req


TEXT_PARTS = ("text", "input_text", "output_text")


def _check_parts(i: int, m: Message) -> None:
    """Content parts moefit cannot read are an error that names them, never dropped."""
    if not isinstance(m.content, list):
        return
    for j, part in enumerate(m.content):
        kind = part.get("type", "text")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            where = f"messages.{i}.content.{j}"
            what = f"type {kind!r}" if kind not in TEXT_PARTS else "a text part without a string 'text'"
            raise ApiError(400, f"{where}: {what} is not supported: this model reads text only", param=where)


def sampling(req: _Sampling, max_tokens: int, grammar: str | None = None, vocab: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          seed=req.seed, stop=req.stops(), ignore_eos=req.ignore_eos,
                          logprobs=req.logprob_count() if hasattr(req, "logprob_count") else None, grammar=grammar,
                          logit_bias=req.bias_pairs(vocab) if getattr(req, "logit_bias", None) else ())


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content, tool-call arguments as objects."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(p["text"] for p in m.content)
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
