"""Split model text into content, reasoning (<think>...</think>) and tool calls, incrementally,
so streams carry each as its own delta. Text that only might start a tag is held back. A call is
either spelling its model's chat template teaches:

    Qwen3 / Hermes   <tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>
    GLM-4.5 / 4.7    <tool_call>f
                     <arg_key>city</arg_key>
                     <arg_value>Paris</arg_value>
                     </tool_call>

GLM's template writes a string argument as it is and any other as JSON, so a value is read as
JSON unless the tool's schema says the parameter is a string."""

from __future__ import annotations

import json
import re
import uuid

TAGS = {"<think>": "reasoning", "</think>": "content", "<tool_call>": "tool", "</tool_call>": "content"}
GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class OutputParser:
    """Usage: p = OutputParser(tools); for kind, value in p.feed(delta): ...; p.finish()"""

    def __init__(self, tools: list | None = None):
        self.mode = "content"
        self.buffer = ""
        self.tool_text = ""
        self.calls = 0
        self.params = _parameters(tools)

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        out = []
        while self.buffer:
            at, tag = self._next_tag()
            if tag is None:
                keep = _partial_tag_suffix(self.buffer)
                self._emit(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._emit(self.buffer[:at], out)
            self.buffer = self.buffer[at + len(tag):]
            self._switch(tag, out)
        return out

    def finish(self) -> list[tuple[str, object]]:
        out = []
        self._emit(self.buffer, out)
        self.buffer = ""
        if self.mode == "tool" and self.tool_text:
            out.append(("content", "<tool_call>" + self.tool_text))        # unterminated: lose nothing
        return out

    def _next_tag(self) -> tuple[int, str | None]:
        hits = [(self.buffer.find(t), t) for t in TAGS if t in self.buffer]
        return min(hits) if hits else (-1, None)

    def _emit(self, text: str, out: list) -> None:
        if not text:
            return
        if self.mode == "tool":
            self.tool_text += text
        elif out and out[-1][0] == self.mode:
            out[-1] = (self.mode, out[-1][1] + text)
        else:
            out.append((self.mode, text))

    def _switch(self, tag: str, out: list) -> None:
        if tag == "</tool_call>" and self.mode == "tool":
            out.append(self._tool_call(self.tool_text))
            self.tool_text = ""
        self.mode = TAGS[tag]

    def _tool_call(self, body: str) -> tuple[str, object]:
        call = _json_call(body) or _glm_call(body, self.params)
        if call is None:
            return ("content", f"<tool_call>{body}</tool_call>")
        name, args = call
        self.calls += 1
        return ("tool_call", {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": name, "arguments": args if isinstance(args, str)
                                           else json.dumps(args, ensure_ascii=False)}})


def _json_call(body: str) -> tuple[str, object] | None:
    try:
        call = json.loads(body)
        return call["name"], call.get("arguments", {})
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def _glm_call(body: str, params: dict) -> tuple[str, dict] | None:
    """GLM's call: the name, then <arg_key> / <arg_value> pairs and nothing else but whitespace."""
    head = body.split("<arg_key>", 1)[0]
    name, args, at = head.strip(), {}, len(head)
    if not name or any(ch.isspace() or ch in "<>{}" for ch in name):
        return None
    for m in GLM_ARG.finditer(body, at):
        if body[at:m.start()].strip():
            return None
        key = m[1].strip()
        args[key] = _glm_value(m[2], params.get(name, {}).get(key))
        at = m.end()
    return (name, args) if not body[at:].strip() else None


def _glm_value(text: str, schema) -> object:
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parameters(tools) -> dict[str, dict]:
    """tool name -> its parameters' schemas, from a request's OpenAI function tools (any shape)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        props = ((fn or {}).get("parameters") or {}).get("properties") if isinstance(fn, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest suffix of text that begins some tag."""
    best = 0
    for tag in TAGS:
        for n in range(1, len(tag)):
            if text.endswith(tag[:n]):
                best = max(best, n)
    return best


def split_final(text: str, tools: list | None = None) -> tuple[str, str | None, list[dict]]:
    """(content, reasoning or None, tool calls) of a complete output."""
    parser = OutputParser(tools)
    items = parser.feed(text) + parser.finish()
    content = "".join(v for k, v in items if k == "content")
    reasoning = "".join(v for k, v in items if k == "reasoning")
    calls = [v for k, v in items if k == "tool_call"]
    return content.strip() if reasoning or calls else content, reasoning.strip() or None, calls
