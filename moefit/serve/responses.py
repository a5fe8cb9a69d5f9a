"""The OpenAI Responses API (`POST /v1/responses`) over the same engine path as chat
completions: input (a string or items: messages, function calls and their outputs),
instructions and function tools become a chat request; the answer is rendered as output
items (reasoning, message with output_text, function_call) or as the Responses stream events.
Stateless: `previous_response_id` is refused with a clear error, `store` is accepted and ignored."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moefit.serve import protocol as P
from moefit.serve.completions import ChatRun


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict | None = None
    seed: int | None = Field(default=None, ge=P.SEED_RANGE[0], le=P.SEED_RANGE[1])
    reasoning: dict | None = None          # {"effort": ...}: the chat template's reasoning_effort


def parse(raw: bytes) -> P.ChatRequest:
    req = P.parse(ResponsesRequest, raw)
    if req.previous_response_id:
        raise P.ApiError(400, "previous_response_id: this server keeps no responses (stateless); send the whole "
                         "conversation as input", param="previous_response_id")
    items = _items(req.input)
    if not items:
        raise P.ApiError(400, "input: must not be empty", param="input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + items
    tools = [_tool(i, t) for i, t in enumerate(req.tools or ())]
    return P.ChatRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                         temperature=req.temperature, top_p=req.top_p, stream=req.stream, seed=req.seed,
                         tools=tools or None, tool_choice=_tool_choice(req.tool_choice),
                         response_format=_format((req.text or {}).get("format")),
                         reasoning_effort=_effort(req.reasoning))


def _effort(reasoning: dict | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    if effort not in (None, "minimal", "low", "medium", "high"):
        raise P.ApiError(400, f"reasoning.effort: {effort!r} is not minimal, low, medium or high",
                         param="reasoning.effort")
    return effort


def _tool_choice(choice):
    """The Responses tool_choice in chat's terms ({"type": "function", "name": X} is flat here)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice if choice in ("none", "required") else None


def _format(fmt: dict | None) -> dict | None:
    """text.format in chat's response_format terms."""
    if not fmt or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def _tool(i: int, t: dict) -> dict:
    if t.get("type") != "function":
        raise P.ApiError(400, f"tools.{i}: tool type {t.get('type')!r} is not supported (function tools only)",
                         param=f"tools.{i}")
    return {"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                             "parameters": t.get("parameters", {})}}


def _items(given) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        elif kind != "reasoning":                     # our own reasoning items come back: the template drops them
            raise P.ApiError(400, f"input.{i}: item type {kind!r} is not supported", param=f"input.{i}")
    return out


def _text(i: int, content) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise P.ApiError(400, f"input.{i}.content.{j}: type {part.get('type')!r} is not supported: this model "
                             "reads text only", param=f"input.{i}.content.{j}")
        parts.append(part.get("text", ""))
    return "".join(parts)


class ResponsesRun(ChatRun):
    prefix = "resp"

    def __init__(self, state, req):
        super().__init__(state, req)
        self.id = self.id.replace("resp-", "resp_", 1)
        self.seq = 0
        self.text = self.all_text = ""             # the answer's text so far; all the model's output
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"

    def response(self, text: str, finish: str) -> dict:
        from moefit.serve.toolparse import split_final
        content, reasoning, calls = split_final(text, self.req.tools)
        output = ([_reasoning(reasoning)] if reasoning else []) + \
            ([_message(self.msg_id, content)] if content or not calls else []) + [_call(c) for c in calls]
        return self._object("incomplete" if finish == "length" else "completed", output, finish)

    def _object(self, status: str, output: list, finish: str | None = None) -> dict:
        s = self.done.stats if self.done else None
        usage = None if s is None else {
            "input_tokens": s.prompt_tokens, "output_tokens": len(s.generated),
            "total_tokens": s.prompt_tokens + len(s.generated), "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.state.model_name, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "parallel_tool_calls": False, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}}

    # -- streaming ------------------------------------------------------------------------
    def event_chunks(self, event) -> list[dict]:
        out = []
        if not self.sent_role:
            self.sent_role = True
            out += [self._ev("response.created", response=self._object("in_progress", [])),
                    self._ev("response.in_progress", response=self._object("in_progress", []))]
        self.all_text += event.text
        items = self.parser.feed(event.text) + (self.parser.finish() if event.finish_reason else [])
        for kind, value in items:
            out += self._delta(kind, value)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        return out

    def _delta(self, kind: str, value) -> list[dict]:
        if kind == "content":
            opened = [] if self.text else [
                self._ev("response.output_item.added", output_index=0, item=_message(self.msg_id, "", "in_progress")),
                self._ev("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})]
            self.text += value
            return opened + [self._ev("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                      content_index=0, delta=value)]
        if kind == "tool_call":
            item = _call(value)
            return [self._ev("response.output_item.added", output_index=1, item={**item, "arguments": ""}),
                    self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=1,
                             delta=item["arguments"]),
                    self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=1,
                             arguments=item["arguments"]),
                    self._ev("response.output_item.done", output_index=1, item=item)]
        return []                                  # reasoning is given whole in the final response

    def stream_chunks(self, item) -> list[dict]:
        if isinstance(item, P.ApiError):
            return [self._ev("error", code=item.code, message=item.message, param=item.param)]
        if item is None:
            if self.done is None:
                return []
            final = self.response(self.all_text, getattr(self, "finish_reason", "stop"))
            done = [self._ev("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                             text=self.text),
                    self._ev("response.output_item.done", output_index=0, item=_message(self.msg_id, self.text))
                    ] if self.text else []
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            return done + [self._ev(kind, response=final)]
        return super().stream_chunks(item)

    def _ev(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def sse(self, chunk: dict) -> str:
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def sse_end(self) -> str:
        return ""


def _message(msg_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": msg_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []}


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

