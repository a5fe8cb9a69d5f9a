"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over the same engine
path as chat completions: the request becomes an OpenAI chat request (system, content blocks,
tool_use / tool_result, tools), and the answer is rendered as Anthropic content blocks
(thinking from the model's <think>, text, tool_use) or as its stream events."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moefit.serve import protocol as P
from moefit.serve.completions import ChatRun

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn",
        "cancelled": "end_turn"}


class AMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = 1


def parse(raw: bytes, kind=MessagesRequest) -> P.ChatRequest:
    """Anthropic body -> the OpenAI chat request the engine path takes (400 naming the field)."""
    req = P.parse(kind, raw)
    messages = _system(req.system) + [m for i, msg in enumerate(req.messages) for m in _messages(i, msg)]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}} for t in req.tools or ()]
    return P.ChatRequest(model=req.model, messages=messages, max_tokens=req.max_tokens, temperature=req.temperature,
                         top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream,
                         tools=tools or None, tool_choice=_tool_choice(req.tool_choice),
                         chat_template_kwargs=_thinking(req.thinking))


def _thinking(thinking: dict | None) -> dict | None:
    """Extended thinking asked on or off, as the chat template's enable_thinking (Qwen3's); not
    asked: the template's default."""
    kind = (thinking or {}).get("type")
    return {"enable_thinking": kind == "enabled"} if kind in ("enabled", "disabled") else None


def _tool_choice(choice: dict | None):
    """Anthropic's tool_choice in OpenAI's terms: any -> required, tool -> that function."""
    kind = (choice or {}).get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return "none" if kind == "none" else None


def _system(system) -> list[dict]:
    if not system:
        return []
    text = system if isinstance(system, str) else "".join(b.get("text", "") for b in system)
    return [{"role": "system", "content": text}]


def _messages(i: int, msg: AMessage) -> list[dict]:
    """One Anthropic message -> OpenAI messages (a user turn's tool results become tool turns)."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    text, thinking, calls, results = [], [], [], []
    for j, block in enumerate(msg.content):
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking":
            thinking.append(block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block.get("content"))})
        else:
            where = f"messages.{i}.content.{j}"
            raise P.ApiError(400, f"{where}: block type {kind!r} is not supported: this model reads text only",
                             param=where)
    out = results[:]
    if text or calls or thinking or not results:
        turn: dict[str, Any] = {"role": msg.role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = "".join(thinking)
        out.append(turn)
    return out


def _result_text(content) -> str:
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if b.get("type") == "text")
    return "" if content is None else str(content)


class MessagesRun(ChatRun):
    prefix = "msg"

    def __init__(self, state, req):
        super().__init__(state, req)
        self.id = self.id.replace("msg-", "msg_", 1)

    def response(self, text: str, finish: str) -> dict:
        from moefit.serve.toolparse import split_final
        content, reasoning, calls = split_final(text, self.req.tools)
        blocks = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []) + \
            ([{"type": "text", "text": content}] if content or not calls else []) + [_tool_use(c) for c in calls]
        stop = "tool_use" if calls and finish == "stop" else STOP.get(finish, "end_turn")
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": blocks, "stop_reason": stop, "stop_sequence": None, "usage": self.anthropic_usage()}

    def anthropic_usage(self) -> dict:
        s = self.done.stats
        return {"input_tokens": s.prompt_tokens, "output_tokens": len(s.generated),
                "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}

    # -- streaming: message_start, content blocks (start / deltas / stop), message_delta, message_stop
    def event_chunks(self, event) -> list[dict]:
        out = []
        if not self.sent_role:
            self.sent_role, self.block, self.kind = True, -1, None
            out.append({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.state.model_name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})
        items = self.parser.feed(event.text) + (self.parser.finish() if event.finish_reason else [])
        for kind, value in items:
            out += self._delta(kind, value)
        if event.finish_reason:
            self.finish = "tool_use" if self.parser.calls and event.finish_reason == "stop" else \
                STOP.get(event.finish_reason, "end_turn")
            out += self._close_block()
        return out

    def _delta(self, kind: str, value) -> list[dict]:
        if kind == "tool_call":
            use = _tool_use(value)
            return self._close_block() + self._open("tool_use", {**use, "input": {}}) + [
                {"type": "content_block_delta", "index": self.block,
                 "delta": {"type": "input_json_delta", "partial_json": value["function"]["arguments"]}}
            ] + self._close_block()
        block, delta = ("thinking", {"type": "thinking_delta", "thinking": value}) if kind == "reasoning" else \
            ("text", {"type": "text_delta", "text": value})
        start = {"type": block, block: "", **({"signature": ""} if block == "thinking" else {})}
        opened = [] if self.kind == block else self._close_block() + self._open(block, start)
        return opened + [{"type": "content_block_delta", "index": self.block, "delta": delta}]

    def _open(self, kind: str, block: dict) -> list[dict]:
        self.block, self.kind = self.block + 1, kind
        return [{"type": "content_block_start", "index": self.block, "content_block": block}]

    def _close_block(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.block}]

    def stream_chunks(self, item) -> list[dict]:
        if isinstance(item, P.ApiError):
            return [anthropic_error(item)]
        if item is None:
            if self.done is None:
                return []
            return [{"type": "message_delta", "delta": {"stop_reason": getattr(self, "finish", "end_turn"),
                                                        "stop_sequence": None},
                     "usage": {"output_tokens": len(self.done.stats.generated)}}, {"type": "message_stop"}]
        return super().stream_chunks(item)

    def sse(self, chunk: dict) -> str:
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def sse_end(self) -> str:
        return ""


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        args = {"_raw": call["function"]["arguments"]}
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": call["function"]["name"],
            "input": args}


def anthropic_error(e: P.ApiError) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(e.status, "api_error"), "message": e.message}}
